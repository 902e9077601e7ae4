"""Checkpoints that cannot be trusted are detected: every file carries a CRC-32 in meta.json, a
truncated / corrupted / missing file is named, `--resume` falls back to the previous good
checkpoint, damaged pointers and meta.json are one-line errors, and a save that fails (a full
disk) leaves the previous checkpoint usable."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

from tessera.checkpoint.dcp import store as ckpt
from tessera.cli import main
from tessera.config import CheckpointError
from tests.checkpoint.untrusted_checkpoints import small_checkpoint
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT, TINY_DENSE, build_small_dataset, set_args, shrink


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return build_small_dataset(tmp_path_factory.mktemp("data"))


def _state(scale: float) -> dict:
    return {"model": {"w": torch.full((64, 64), scale), "b": torch.arange(3.0)}, "trainer": json.dumps({"s": scale})}


def _two_checkpoints(root):
    for step in (1, 2):
        ckpt.save_checkpoint(root, step, _state(float(step)), {}, keep_last=2)
    return root / "step_00000001", root / "step_00000002"


def _shard(path):
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


def _truncate(f):
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # what a SIGKILL halfway through the write leaves


def _flip(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, expected", [(_truncate, "bytes, .* were written"), (_flip, "crc32 checksum"),
                                              (os.unlink, "missing")])
def test_a_damaged_newest_checkpoint_is_named_and_skipped(tmp_path, damage, expected):
    first, second = _two_checkpoints(tmp_path)
    meta = ckpt.read_meta(second)
    assert sorted(meta["files"]) == [".metadata", _shard(second).name]
    assert ckpt.find_latest_good(tmp_path) == (second, [])
    damage(_shard(second))
    found, skipped = ckpt.find_latest_good(tmp_path)
    assert found == first and len(skipped) == 1
    assert "step_00000002" in skipped[0] and "__0_0.distcp" in skipped[0]
    assert any(__import__("re").search(expected, s) for s in skipped)
    with pytest.raises(CheckpointError, match="step_00000002.*is damaged.*__0_0.distcp"):
        ckpt.verified(second)


def test_damaged_metadata_is_detected_too(tmp_path):
    first, second = _two_checkpoints(tmp_path)
    _truncate(second / ".metadata")
    assert ckpt.find_latest_good(tmp_path)[0] == first


def test_damaged_latest_pointer_falls_back_to_the_newest_complete(tmp_path):
    _, second = _two_checkpoints(tmp_path)
    for garbage in (b"\xff\xfe\x00\x01", b"../../etc\n", b"step_00000009\n", b""):
        (tmp_path / "latest").write_bytes(garbage)
        assert ckpt.find_latest(tmp_path) == second
        assert ckpt.find_latest_good(tmp_path) == (second, [])


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_damaged_meta_json_is_one_line(tmp_path, content, capsys):
    checkpoint = small_checkpoint(tmp_path / "ckpt")
    (checkpoint / "meta.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="meta.json"):
        ckpt.read_meta(checkpoint)
    assert main(["convert", str(checkpoint), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tessera convert: error: ") and err.count("\n") == 1 and "meta.json" in err


def test_resume_says_which_checkpoint_and_file_and_falls_back(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, run, 4, **{"checkpoint.keep_last": 2}))]) == 0
    root = run / "checkpoints"
    _flip(_shard(root / "step_00000004"))
    capsys.readouterr()
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, run, 5, **{"checkpoint.keep_last": 2})),
                 "--resume"]) == 0
    err = capsys.readouterr().err.splitlines()
    warning = [line for line in err if "damaged" in line]
    assert len(warning) == 1 and "step_00000004" in warning[0] and "__0_0.distcp" in warning[0]
    assert any("resuming from" in line and "step_00000002" in line for line in err)
    assert ckpt.read_meta(ckpt.find_latest(root))["step"] == 5


def test_a_failed_save_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    first = ckpt.save_checkpoint(tmp_path, 1, _state(1.0), {}, keep_last=2)

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)  # where a full disk surfaces for buffered writes
    with pytest.raises(CheckpointError, match="cannot save checkpoint .*step_00000002.*No space left on device"):
        ckpt.save_checkpoint(tmp_path, 2, _state(2.0), {}, keep_last=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]  # no leftovers
    assert ckpt.find_latest_good(tmp_path) == (first, [])
    target = _state(0.0)
    ckpt.load_checkpoint(first, target)
    assert torch.equal(target["model"]["w"], torch.full((64, 64), 1.0))


@pytest.mark.slow
def test_file_size_limit_during_a_real_save_is_one_line(dataset, tmp_path):
    """The operating system refuses the write itself (RLIMIT_FSIZE, like a full disk)."""
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, run, 2))]) == 0
    previous = ckpt.find_latest(run / "checkpoints")
    limit = _shard(previous).stat().st_size // 2

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "tessera", "train", TINY_DENSE,
                           *set_args(shrink(dataset, run, 4)), "--resume"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=limit_file_size, timeout=HANG_S)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and last.startswith("tessera train: error: cannot save checkpoint")
    assert "step_00000004" in last and "previous checkpoint" in last
    root = run / "checkpoints"
    assert ckpt.find_latest_good(root) == (previous, [])
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
