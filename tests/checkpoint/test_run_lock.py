"""One trainer per run directory: a second one is refused, naming the holder's PID, and touches
nothing; a run_dir that is a file or cannot be written is refused before any model is built."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.run_lock import RunDirLock
from tessera.cli import main
from tessera.config import ConfigError
from tests.checkpoint.unwritable_dirs import run_with_read_only
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT, TINY_DENSE, build_small_dataset, set_args, shrink

HOLD_LOCK = ("import sys, time\nfrom tessera.checkpoint.dcp.run_lock import RunDirLock\n"
             "lock = RunDirLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(120)\n")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return build_small_dataset(tmp_path_factory.mktemp("data"))


def _start(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=HANG_S)
    proc.stdout.close()
    proc.stderr.close()


def test_a_second_trainer_is_refused_and_touches_nothing(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    holder = _start(["-c", HOLD_LOCK, str(run)])
    try:
        assert holder.stdout.readline().strip() == "locked"
        partial = run / "checkpoints" / ".tmp-step_00000002-1"  # the holder's save in progress
        partial.mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        for resume in ([], ["--resume"]):
            assert main(["train", TINY_DENSE, *set_args(shrink(dataset, run, 2)), *resume]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("tessera train: error: ")
            assert f"in use by another trainer (PID {holder.pid})" in err
        assert partial.is_dir() and (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    finally:
        _stop(holder)
    # the kernel dropped the dead holder's lock: the run directory is usable again
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, run, 2)), "--resume"]) == 0


def test_lock_is_exclusive_and_released(tmp_path):
    with RunDirLock(tmp_path / "run") as lock:
        assert lock.held and (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())
        with pytest.raises(ConfigError, match=f"PID {os.getpid()}"):
            RunDirLock(tmp_path / "run").acquire()
    RunDirLock(tmp_path / "run").acquire().release()


def test_run_dir_that_is_a_file_is_refused_before_the_model_is_built(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    run.write_text("not a directory")
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, run, 2))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file" in err and str(run) in err


@pytest.mark.parametrize("where", ["run_dir", "its parent"])
def test_read_only_run_dir_is_refused_before_the_model_is_built(dataset, tmp_path, where):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    run = read_only if where == "run_dir" else read_only / "run"
    proc = run_with_read_only(read_only, ["train", TINY_DENSE, *set_args(shrink(dataset, run, 2))])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "cannot be written" in proc.stderr and str(run) in proc.stderr


@pytest.mark.slow
def test_a_running_trainer_keeps_its_run_directory(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    first = _start(["-m", "tessera", "train", TINY_DENSE, *set_args(shrink(dataset, run, 4))],
                   {ckpt.PAUSE_HOOK_ENV: f"2:{HANG_S}"})  # paused until stopped
    try:
        deadline = time.monotonic() + HANG_S
        for line in first.stderr:  # the first trainer is in the middle of saving step 2
            if "tessera-test-hook: paused in save of step 2" in line:
                break
            assert time.monotonic() < deadline
        partial = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-step_00000002")]
        metrics = (run / "metrics.jsonl").read_text()
        assert main(["train", TINY_DENSE, *set_args(shrink(dataset, run, 4)), "--resume"]) == 2
        assert f"PID {first.pid}" in capsys.readouterr().err
        assert partial and all(p.is_dir() for p in partial)
        assert (run / "metrics.jsonl").read_text() == metrics
    finally:
        _stop(first)
