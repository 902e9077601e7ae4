"""The DCP checkpoint directory protocol: atomic saves, the latest pointer, fallbacks, mismatches."""

from __future__ import annotations

import pickle

import pytest
import torch

from tessera.checkpoint.dcp import store as ckpt
from tessera.config.errors import CheckpointError


def _state(scale: float) -> dict:
    return {"model": {"w": torch.full((2, 3), scale), "b": torch.arange(3.0)}, "extra": pickle.dumps({"s": scale})}


def test_round_trip_and_pointer(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 7, _state(1.5), {"note": "x"}, keep_last=3)
    assert path == tmp_path / "step_00000007" and ckpt.is_complete(path)
    assert (tmp_path / "latest").read_text().strip() == "step_00000007"
    meta = ckpt.read_meta(path)
    assert sorted(meta.pop("files")) == [".metadata", "__0_0.distcp"]  # with their sizes and checksums
    assert meta == {"step": 7, "format": 1, "note": "x"}
    target = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}, "extra": b""}
    ckpt.load_checkpoint(path, target)
    assert torch.equal(target["model"]["w"], torch.full((2, 3), 1.5))
    assert pickle.loads(target["extra"]) == {"s": 1.5}
    assert ckpt.resolve_checkpoint(tmp_path) == path == ckpt.resolve_checkpoint(path)


def test_incomplete_and_dangling_checkpoints_are_ignored(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, _state(1.0), {}, keep_last=3)
    ckpt.save_checkpoint(tmp_path, 2, _state(2.0), {}, keep_last=3)
    (tmp_path / "step_00000002" / "meta.json").unlink()  # as if the save of 2 never completed
    (tmp_path / ".tmp-step_00000003-1").mkdir()
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_00000001"  # latest names 2: fall back
    assert ckpt.remove_partial_saves(tmp_path) == [tmp_path / ".tmp-step_00000003-1"]
    (tmp_path / "latest").write_text("step_00000009\n")
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_00000001"


def test_a_replaced_checkpoint_comes_back_if_its_replacement_never_landed(tmp_path):
    ckpt.save_checkpoint(tmp_path, 4, _state(4.0), {}, keep_last=1)
    (tmp_path / "step_00000004").rename(tmp_path / ".old-step_00000004-99")  # crash mid-replacement
    assert ckpt.find_latest(tmp_path) is None
    assert ckpt.remove_partial_saves(tmp_path) == []
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_00000004"


def test_keep_last_and_saving_the_same_step_again(tmp_path):
    for step in (1, 2, 3, 3):
        ckpt.save_checkpoint(tmp_path, step, _state(float(step)), {}, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]


def test_mismatch_names_the_key(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, _state(1.0), {}, keep_last=1)
    ckpt.check_compatible(path, "model", {"w": (2, 3), "b": (3,)})
    with pytest.raises(CheckpointError, match=r"'w' has shape \[2, 3\] there but \[4, 3\]"):
        ckpt.check_compatible(path, "model", {"w": (4, 3), "b": (3,)})
    with pytest.raises(CheckpointError, match="it has no 'c'"):
        ckpt.check_compatible(path, "model", {"w": (2, 3), "b": (3,), "c": (1,)})
    with pytest.raises(CheckpointError, match="it has 'b', which the model lacks"):
        ckpt.check_compatible(path, "model", {"w": (2, 3)})
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.resolve_checkpoint(tmp_path / "nowhere")
