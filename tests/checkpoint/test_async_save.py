"""`checkpoint.async: true`: checkpoints written by a background thread from a CPU copy of the state,
while training goes on. They are the checkpoints a synchronous save writes (every tensor, the RNG
and data position, checksums, `latest`), also sharded under FSDP; a kill while one is written
leaves the previous checkpoint and resumes bit for bit; a background save that fails is one line
and leaves the previous checkpoint usable."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tessera.checkpoint.dcp import store as ckpt
from tessera.cli import main
from tessera.config.schema import load_config
from tessera.train.run.metrics_writer import read_metrics
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT, TINY_DENSE, TINY_MOE, moe_shrink, read_losses, set_args, shrink

ASYNC = {"checkpoint.async": True}


def _tensors(path: Path, scratch: Path) -> dict:
    """Every stored key of checkpoint `path` (tensors and objects), read by DCP's own converter."""
    dcp_to_torch_save(path, scratch)

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return flat(torch.load(scratch, weights_only=False))


def _assert_same_checkpoints(a_root: Path, b_root: Path, scratch: Path) -> None:
    a, b = ckpt.list_checkpoints(a_root), ckpt.list_checkpoints(b_root)
    assert [s for s, _ in a] == [s for s, _ in b] and a
    assert (a_root / ckpt.LATEST).read_text() == (b_root / ckpt.LATEST).read_text()
    for (step, pa), (_, pb) in zip(a, b, strict=True):
        assert ckpt.checkpoint_problem(pa) is None and ckpt.checkpoint_problem(pb) is None
        ta, tb = _tensors(pa, scratch / "a.pt"), _tensors(pb, scratch / "b.pt")
        assert ta.keys() == tb.keys(), step
        for key in ta:
            same = torch.equal(ta[key], tb[key]) if isinstance(ta[key], torch.Tensor) else ta[key] == tb[key]
            assert same, (step, key)


def test_background_checkpoints_equal_synchronous_ones(small_dataset, tmp_path):
    every = {"checkpoint.interval": 1, "checkpoint.keep_last": 3}
    sync = Trainer(load_config(TINY_MOE, moe_shrink(small_dataset, tmp_path / "sync", 5, **every))).train()
    background = Trainer(load_config(TINY_MOE, moe_shrink(small_dataset, tmp_path / "async", 5, **every,
                                                          **ASYNC)))
    result = background.train()
    assert background.background.in_flight is None  # the last save was waited for before train() returned
    assert result.checkpoint == tmp_path / "async" / "checkpoints" / "step_00000005"
    assert [r["loss"] for r in result.records] == [r["loss"] for r in sync.records]
    _assert_same_checkpoints(tmp_path / "sync" / "checkpoints", tmp_path / "async" / "checkpoints", tmp_path)


def _train_sync_then_async(dataset: str, root: str) -> None:
    """On each rank: the same FSDP run twice, saving synchronously, then in the background."""
    for name, extra in (("sync", {}), ("async", ASYNC)):
        overrides = shrink(dataset, Path(root) / name, 4, **{"parallel.dp_shard": 2, "optim.eps": 1e-3,
                                                             "checkpoint.interval": 1, **extra})
        Trainer(load_config(TINY_DENSE, overrides)).train()


@pytest.mark.dist
def test_background_checkpoints_of_fsdp_shards_equal_synchronous_ones(small_dataset, tmp_path):
    """Each rank copies and writes only its shards, in the saves' own process group."""
    run_ranks(_train_sync_then_async, 2, small_dataset, str(tmp_path), timeout=HANG_S)
    _assert_same_checkpoints(tmp_path / "sync" / "checkpoints", tmp_path / "async" / "checkpoints", tmp_path)
    shards = sorted(p.name for p in (tmp_path / "async" / "checkpoints" / "step_00000004").glob("*.distcp"))
    assert [name[:4] for name in shards] == ["__0_", "__1_"]


def _digest(directory: Path) -> list[tuple[str, bytes]]:
    return [(p.name, p.read_bytes()) for p in sorted(directory.iterdir())]


@pytest.mark.slow
def test_training_goes_on_during_a_background_save_and_a_kill_keeps_the_previous_checkpoint(small_dataset,
                                                                                           tmp_path):
    """The save of step 4 is held (the store's test hook) after its files are written: the run trains
    and logs steps 5 and 6 meanwhile, then waits for it before saving step 6. Killed then, it leaves
    step 2 as the newest checkpoint, and the resumed run logs each step once with the losses of an
    uninterrupted one."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    overrides = moe_shrink(small_dataset, run, 8, **ASYNC)
    env = {**os.environ, "OMP_NUM_THREADS": "1", ckpt.PAUSE_HOOK_ENV: f"4:{HANG_S}"}
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "train", TINY_MOE, *set_args(overrides)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = run / "checkpoints"
    try:
        for line in proc.stderr:
            if "tessera-test-hook: paused in save of step 4" in line:
                break
        else:
            pytest.fail(f"the save hook never ran; exit {proc.wait()}")
        deadline = time.monotonic() + HANG_S
        while max(r["step"] for r in read_metrics(run)) < 6:  # steps trained while step 4 is being saved
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert (root / ckpt.LATEST).read_text().strip() == "step_00000002"
        assert [p for p in root.iterdir() if p.name.startswith(".tmp-step_00000004")]
        before = _digest(root / "step_00000002")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=HANG_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert ckpt.find_latest_good(root) == (root / "step_00000002", [])
    assert _digest(root / "step_00000002") == before

    assert main(["train", TINY_MOE, *set_args(overrides), "--resume"]) == 0
    assert main(["train", TINY_MOE, *set_args(moe_shrink(small_dataset, reference, 8))]) == 0
    lines = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines == list(range(1, 9))
    assert read_losses(run) == read_losses(reference)
    final = _tensors(ckpt.find_latest(root), tmp_path / "a.pt")
    expected = _tensors(ckpt.find_latest(reference / "checkpoints"), tmp_path / "b.pt")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) if isinstance(final[k], torch.Tensor) else final[k] == expected[k]
               for k in final)


@pytest.mark.slow
def test_a_background_save_that_fails_is_one_line_and_keeps_the_previous_checkpoint(small_dataset, tmp_path):
    """The operating system refuses the background thread's write (RLIMIT_FSIZE, as a full disk does):
    the run ends with the save's error in one line (exit 1), and the previous checkpoint is the newest."""
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, run, 2, **ASYNC))]) == 0
    previous = ckpt.find_latest(run / "checkpoints")
    limit = next(previous.glob("*.distcp")).stat().st_size // 2

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "tessera", "train", TINY_DENSE,
                           *set_args(shrink(small_dataset, run, 4, **ASYNC)), "--resume"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          preexec_fn=limit_file_size, timeout=HANG_S)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and last.startswith("tessera train: error: cannot save checkpoint"), last
    assert "step_00000004" in last and "previous checkpoint" in last
    root = run / "checkpoints"
    assert ckpt.find_latest_good(root) == (previous, [])
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
