"""Checkpoint/resume: bit-exact continuation, crash safety of saves, graceful stop on SIGTERM."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.checkpoint import dcp as ckpt
from tessera.cli import main
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
    proc = _start([TINY_MOE, *set_args(overrides)], {ckpt.PAUSE_HOOK_ENV: "4:120"})
    try:
        deadline = time.monotonic() + 120
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
        assert proc.wait(timeout=30) == -signal.SIGKILL
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
