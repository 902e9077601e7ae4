"""`tessera train --nproc N` and torchrun: N local ranks (one too), one metrics.jsonl written by rank 0,
the same losses as one process; a layout the ranks cannot take is refused before any rank starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.checkpoint.dcp import store as ckpt
from tessera.cli import main
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT, TINY_DENSE, read_losses, set_args, shrink, sigterm_after_two_logged_steps

FSDP2 = {"parallel.dp_shard": 2, "optim.eps": 1e-3}  # eps: see tests/parallel/trainer_runs.py


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_nproc_2_trains_like_one_process(small_dataset, tmp_path, capfd):
    overrides = shrink(small_dataset, tmp_path / "ranks", 3, **FSDP2)
    assert main(["train", TINY_DENSE, *set_args(overrides), "--nproc", "2"]) == 0
    out = capfd.readouterr().out
    assert out.count("trained steps 1..3") == 1  # the summary comes from rank 0 only
    assert [r["step"] for r in _metrics(tmp_path / "ranks")] == [1, 2, 3]
    latest = ckpt.find_latest(tmp_path / "ranks" / "checkpoints")
    assert {"rng.rank0", "rng.rank1"} <= set(ckpt.checkpoint_tensor_shapes(latest))
    single = shrink(small_dataset, tmp_path / "one", 3, **{"optim.eps": 1e-3})
    assert main(["train", TINY_DENSE, *set_args(single)]) == 0
    got, want = read_losses(tmp_path / "ranks"), read_losses(tmp_path / "one")
    assert got.keys() == want.keys() and all(abs(got[s] - want[s]) <= 1e-5 * want[s] for s in want)


@pytest.mark.dist
def test_nproc_1_trains_one_rank_in_a_process_group_like_one_process(small_dataset, tmp_path, capfd):
    """`--nproc 1` launches one rank as `--nproc N` launches N (as torchrun --nproc-per-node 1
    would): it runs in a process group of one (gloo here, NCCL on a GPU: tests/gpu), through the
    layouts' step; without --nproc the command trains in its own process, with no group."""
    overrides = shrink(small_dataset, tmp_path / "rank", 3, **{"optim.eps": 1e-3})
    assert main(["train", TINY_DENSE, *set_args(overrides), "--nproc", "1"]) == 0
    assert "\nlayout: 1 rank on cpu, gloo process group\n" in capfd.readouterr().err
    single = shrink(small_dataset, tmp_path / "one", 3, **{"optim.eps": 1e-3})
    assert main(["train", TINY_DENSE, *set_args(single)]) == 0
    assert "\nlayout: 1 process on cpu\n" in capfd.readouterr().err
    got, want = read_losses(tmp_path / "rank"), read_losses(tmp_path / "one")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    assert all(abs(got[s] - want[s]) <= 1e-5 * want[s] for s in want), (got, want)


def test_nproc_that_the_layout_cannot_take_is_refused_before_starting(small_dataset, tmp_path, capsys):
    overrides = shrink(small_dataset, tmp_path / "run", 3, **FSDP2)
    assert main(["train", TINY_DENSE, *set_args(overrides), "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dp_shard=2" in err and "the world has 3" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_runs_the_same_command(small_dataset, tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this interpreter")
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "tessera", "train", TINY_DENSE,
                           *set_args(shrink(small_dataset, run, 2, **FSDP2))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in _metrics(run)] == [1, 2]
    assert proc.stdout.count("trained steps 1..2") == 1


@pytest.mark.dist
@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step(small_dataset, tmp_path):
    run = tmp_path / "run"
    overrides = shrink(small_dataset, run, 10_000, **{**FSDP2, "checkpoint.interval": 0})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tessera", "train", TINY_DENSE, *set_args(overrides), "--nproc", "2"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    last_logged = sigterm_after_two_logged_steps(proc, run)
    latest = ckpt.find_latest(run / "checkpoints")
    assert latest is not None and ckpt.read_meta(latest)["step"] == last_logged < 10_000


@pytest.mark.dist
@pytest.mark.slow
def test_ranks_of_a_killed_launcher_save_and_stop(small_dataset, tmp_path):
    run = tmp_path / "run"
    overrides = shrink(small_dataset, run, 10_000, **{**FSDP2, "checkpoint.interval": 0})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tessera", "train", TINY_DENSE, *set_args(overrides), "--nproc", "2"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + HANG_S
        while not ((run / "metrics.jsonl").exists() and len(_metrics(run)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: the launcher cannot forward anything
        proc.wait()
    deadline = time.monotonic() + HANG_S
    while ckpt.find_latest(run / "checkpoints") is None:  # the ranks notice, finish the step and save
        assert time.monotonic() < deadline, "the ranks did not save after their launcher died"
        time.sleep(0.1)
    time.sleep(0.5)  # the last metrics line is written before the save; let rank 0 finish closing
    assert ckpt.read_meta(ckpt.find_latest(run / "checkpoints"))["step"] == max(read_losses(run)) < 10_000


@pytest.mark.parametrize("launcher", [{"WORLD_SIZE": "1"}, {"WORLD_SIZE": "2"},
                                      {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}],
                         ids=["one-process", "rank-of-2", "rank-of-1"])
def test_a_failed_rank_exits_without_the_interpreters_teardown(tmp_path, launcher):
    """A rank that failed (of a job of 2, or of 1 as `--nproc 1` and torchrun start it: WORLD_SIZE
    with the rendezvous address) ends with its error's status and skips the teardown (where torch's
    half-built process groups can abort it with 134); one process and a rank that succeeded end
    normally. An atexit hook, installed through sitecustomize, tells which."""
    marker = tmp_path / "teardown-ran"
    (tmp_path / "sitecustomize.py").write_text(
        f"import atexit, pathlib\natexit.register(pathlib.Path({str(marker)!r}).touch)\n")
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
           "RANK": "0", **launcher}
    out = subprocess.run([sys.executable, "-m", "tessera", "train", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, env=env, timeout=HANG_S)
    assert out.returncode == 2 and "missing.yaml" in out.stderr, out.stderr
    assert marker.exists() == ("MASTER_ADDR" not in launcher and launcher["WORLD_SIZE"] == "1")
    ok = subprocess.run([sys.executable, "-m", "tessera", "--version"], capture_output=True, text=True, env=env,
                        timeout=HANG_S)
    assert ok.returncode == 0 and marker.exists(), ok.stderr


def test_an_unexpected_error_in_a_rank_is_reported_once_with_status_1(tmp_path):
    """An exception the command does not turn into a message (a bug, an out-of-memory error)
    prints its traceback once and ends the rank with Python's status 1, teardown skipped."""
    marker = tmp_path / "teardown-ran"
    (tmp_path / "sitecustomize.py").write_text(
        f"import atexit, pathlib\natexit.register(pathlib.Path({str(marker)!r}).touch)\n"
        "import tessera.cli\n"
        "def boom(argv=None):\n    raise RuntimeError('out of memory, say')\n"
        "tessera.cli.main = boom\n")
    for world_size in ("2", "1"):
        env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
               "WORLD_SIZE": world_size, "RANK": "0"}
        out = subprocess.run([sys.executable, "-m", "tessera", "train", "x.yaml"], capture_output=True, text=True,
                             env=env, timeout=HANG_S)
        assert out.returncode == 1 and out.stderr.count("RuntimeError: out of memory, say") == 1, out.stderr
        assert marker.exists() == (world_size == "1")
