"""Checkpoint/resume: bit-exact continuation, crash safety of saves, graceful stop on SIGTERM."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.checkpoint.dcp import store as ckpt
from tessera.cli import main
from tessera.config.schema import load_config
from tessera.train.trainer import Trainer
from tests.hang_guard import HANG_S
from tests.train.runs import (
    ROOT,
    TINY_DENSE,
    TINY_MOE,
    moe_shrink,
    read_losses,
    set_args,
    shrink,
    sigterm_after_two_logged_steps,
)


def _train(config: str, overrides: list[str], resume: bool = False) -> int:
    return main(["train", config, *set_args(overrides), *(["--resume"] if resume else [])])


def test_moe_stop_and_resume_is_bit_exact(small_dataset, tmp_path):
    k = 3
    assert _train(TINY_MOE, moe_shrink(small_dataset, tmp_path / "full", 2 * k)) == 0
    assert _train(TINY_MOE, moe_shrink(small_dataset, tmp_path / "split", k)) == 0
    assert _train(TINY_MOE, moe_shrink(small_dataset, tmp_path / "split", 2 * k), resume=True) == 0
    full, split = read_losses(tmp_path / "full"), read_losses(tmp_path / "split")
    assert sorted(split) == list(range(1, 2 * k + 1))  # one line per step, none repeated
    for step in range(k + 1, 2 * k + 1):
        assert split[step] == full[step], step  # fp32 on CPU: bit for bit


def test_keep_last_and_latest_pointer(small_dataset, tmp_path):
    assert _train(TINY_DENSE, shrink(small_dataset, tmp_path, 5, **{"checkpoint.interval": 1,
                                                                   "checkpoint.keep_last": 2})) == 0
    root = tmp_path / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [4, 5]
    assert (root / "latest").read_text().strip() == "step_00000005"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _start(args: list[str], env_extra: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.Popen([sys.executable, "-m", "tessera", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigkill_during_save_keeps_previous_checkpoint(small_dataset, tmp_path):
    run = tmp_path / "run"
    overrides = moe_shrink(small_dataset, run, 6)
    # The save of step 4 pauses after its DCP files are written into the temporary directory.
    proc = _start([TINY_MOE, *set_args(overrides)], {ckpt.PAUSE_HOOK_ENV: f"4:{HANG_S}"})
    try:
        deadline = time.monotonic() + HANG_S
        for line in proc.stderr:
            if "tessera-test-hook: paused in save of step 4" in line:
                break
            assert time.monotonic() < deadline
        else:
            pytest.fail(f"the save hook never ran; exit {proc.wait()}")
        partial = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-step_00000004")]
        assert partial and any(partial[0].iterdir())  # the kill lands with the save half done
        before = _digest(run / "checkpoints" / "step_00000002")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=HANG_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert _digest(root / "step_00000002") == before
    assert ckpt.find_latest(root) == root / "step_00000002"

    assert _train(TINY_MOE, overrides, resume=True) == 0
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]  # leftovers cleaned
    assert _train(TINY_MOE, moe_shrink(small_dataset, tmp_path / "reference", 6)) == 0
    resumed, reference = read_losses(run), read_losses(tmp_path / "reference")
    assert sorted(resumed) == list(range(1, 7))
    assert all(resumed[s] == reference[s] for s in range(3, 7))


@pytest.mark.slow
def test_sigterm_saves_then_exits(small_dataset, tmp_path):
    run = tmp_path / "run"
    overrides = shrink(small_dataset, run, 10_000, **{"checkpoint.interval": 0})
    proc = _start([TINY_DENSE, *set_args(overrides)], {})
    last_logged = sigterm_after_two_logged_steps(proc, run)
    latest = ckpt.find_latest(run / "checkpoints")
    assert latest is not None and ckpt.read_meta(latest)["step"] == last_logged
    assert last_logged < 10_000


def test_resume_after_crash_while_replacing_the_same_step(small_dataset, tmp_path):
    """A save of step N when step_N exists moves it to `.old-step_N-PID`, renames the new save from
    `.tmp-step_N-PID` into place and only then deletes the old one (dcp._complete). A crash between
    the two renames leaves both aside and `latest` naming the missing step_N: resume must put the
    old step_N back first and continue from it, not from an older checkpoint."""
    overrides = shrink(small_dataset, tmp_path, 2, **{"checkpoint.interval": 1, "checkpoint.keep_last": 3})
    Trainer(load_config(TINY_DENSE, overrides)).train()
    root = tmp_path / "checkpoints"
    final = root / ckpt.step_dir_name(2)
    pid = 4242
    old, new = root / f".old-{final.name}-{pid}", root / f".tmp-{final.name}-{pid}"
    shutil.copytree(final, new)  # the second save of step 2, complete with meta.json
    os.rename(final, old)  # ... and the crash came before `os.rename(tmp, final)`
    assert (root / ckpt.LATEST).read_text().strip() == final.name
    assert ckpt.find_latest(root) == root / ckpt.step_dir_name(1)  # what a resume decided before cleanup

    resumed = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path, 3, **{"checkpoint.interval": 1,
                                                                                    "checkpoint.keep_last": 3})),
                      resume=True)
    assert resumed.step == 2 and resumed.resumed_from == final
    assert ckpt.is_complete(final) and not old.exists() and not new.exists()
    result = resumed.train()
    assert result.start_step == 2 and [r["step"] for r in result.records] == [3]
