"""The HuggingFace export of a Tessera checkpoint read one shard file at a time
(tessera.checkpoint.hf.export) writes what `save_pretrained` writes for the loaded model, file for
file and byte for byte; split into several files it loads in transformers with the model's logits
while holding at most about one file's tensors; a damaged checkpoint is refused, naming the file,
and leaves the destination as it was. The run's own export (checkpoint.export_hf) is the same."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.model import load_tessera_model, save_model_checkpoint
from tessera.checkpoint.hf.export import export_checkpoint_to_hf
from tessera.config import CheckpointError, ConfigError
from tessera.config.presets import get_preset
from tessera.config.schema import load_config
from tessera.data.tokenizer import default_tokenizer
from tessera.hf import save_pretrained
from tessera.models.transformer import Transformer
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink

SMALL_SHARDS = 30_000  # bytes: many files for the 2.4 MB model, experts of one weight across two files
# The 1 MiB embedding and LM head get a file each, both layers (~0.3 MB) share one: holding two files
# at once passes the bound of one file or one larger tensor.
LARGE_SHARDS = 700_000


@pytest.fixture(scope="module")
def run(small_dataset, tmp_path_factory) -> Path:
    """Two steps of the shrunken tiny MoE (Mixtral) in one process, exported at the end of the run."""
    run_dir = tmp_path_factory.mktemp("streamed") / "run"
    result = Trainer(load_config(TINY_MOE, moe_shrink(small_dataset, run_dir, 2, **{"checkpoint.export_hf": True}))
                     ).train()
    assert result.written == run_dir / "hf" and result.checkpoint == run_dir / "checkpoints" / "step_00000002"
    return run_dir


def _same_directories(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("dtype,max_shard_bytes", [(torch.float32, 5 * 2**30), (torch.float32, SMALL_SHARDS),
                                                   (torch.bfloat16, SMALL_SHARDS)])
def test_streamed_export_writes_what_save_pretrained_writes(run, tmp_path, dtype, max_shard_bytes):
    result = export_checkpoint_to_hf(run, tmp_path / "streamed", dtype=dtype, tokenizer="default",
                                     max_shard_bytes=max_shard_bytes)
    model, _ = load_tessera_model(run, dtype=dtype)
    save_pretrained(model, tmp_path / "whole", max_shard_bytes=max_shard_bytes, tokenizer="default")
    _same_directories(tmp_path / "streamed", tmp_path / "whole")
    assert result.checkpoint == run / "checkpoints" / "step_00000002"
    assert (len(result.files) > 1) == (max_shard_bytes == SMALL_SHARDS)
    if dtype == torch.float32 and len(result.files) == 1:  # the run's own export is the same directory
        _same_directories(run / "hf", tmp_path / "whole")


@pytest.mark.parametrize("max_shard_bytes", [SMALL_SHARDS, LARGE_SHARDS])
def test_export_holds_one_file_at_a_time(run, tmp_path, max_shard_bytes):
    out = tmp_path / "hf"
    result = export_checkpoint_to_hf(run, out, tokenizer="default", max_shard_bytes=max_shard_bytes)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == result.files and len(result.files) >= 3
    largest = max(t.nbytes for f in result.files for t in load_file(out / f).values())
    assert result.peak_bytes <= max(max_shard_bytes, largest)  # a file's tensors, or one larger tensor alone
    assert result.peak_bytes <= result.total_bytes / 2  # never the whole model


def test_multi_file_export_loads_in_transformers(run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    export_checkpoint_to_hf(run, out, tokenizer="default", max_shard_bytes=SMALL_SHARDS)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 10
    split = [w for w in ("w1", "w2", "w3") for i in range(2)
             if len({weight_map[f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight"] for j in range(4)}) > 1]
    assert split, "no expert weight spans two files: the test would not read boxes of a stacked weight"
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ours, _ = load_tessera_model(run)
    ids = torch.tensor([default_tokenizer().encode("def main(argv):\n    return sorted(argv)")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_damaged_checkpoint_is_named_and_the_destination_kept(run, tmp_path):
    step = tmp_path / "step_00000002"
    shutil.copytree(run / "checkpoints" / "step_00000002", step)
    out = tmp_path / "hf"
    export_checkpoint_to_hf(step, out, tokenizer="default")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    shard = next(p for p in step.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"step_00000002.*is damaged.*{shard.name}.*crc32"):
        export_checkpoint_to_hf(step, out, tokenizer="default", max_shard_bytes=SMALL_SHARDS)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "step_00000002"]  # no temporary directory left


def test_a_destination_with_foreign_files_is_refused(run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="notes.txt.*new or empty directory"):
        export_checkpoint_to_hf(run, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and not ckpt.find_latest(out)


def _files_as_they_are(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in [root, *root.rglob("*")]}


def test_a_run_resumed_at_its_last_step_exports_its_checkpoint(run, small_dataset, tmp_path):
    """It exports the checkpoint it resumed from as it is, without first saving the same step again."""
    before = _files_as_they_are(run / "checkpoints")
    overrides = moe_shrink(small_dataset, run, 2, **{"checkpoint.export_hf": True,
                                                     "checkpoint.export_hf_dir": str(tmp_path / "hf")})
    result = Trainer(load_config(TINY_MOE, overrides), resume=True).train()
    assert (result.start_step, result.last_step, result.written) == (2, 2, tmp_path / "hf")
    assert result.checkpoint is None and _files_as_they_are(run / "checkpoints") == before
    _same_directories(tmp_path / "hf", run / "hf")


def test_a_relative_export_directory_is_under_run_dir(run, small_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = moe_shrink(small_dataset, run, 2, **{"checkpoint.export_hf": True,
                                                     "checkpoint.export_hf_dir": "exports/hf"})
    try:
        result = Trainer(load_config(TINY_MOE, overrides), resume=True).train()
        assert result.written == run / "exports" / "hf"
        _same_directories(run / "exports" / "hf", run / "hf")
        assert list(tmp_path.iterdir()) == []
    finally:
        shutil.rmtree(run / "exports", ignore_errors=True)


def _stop_signal_after(trainer: Trainer, step: int) -> None:
    """SIGTERM to this process right after optimizer step `step`, as from a scheduler."""
    train_step = trainer.train_step

    def step_then_signal():
        stats = train_step()
        if trainer.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return stats

    trainer.train_step = step_then_signal


@pytest.mark.parametrize("signal_at,exported", [(2, True), (1, False)])
def test_a_stop_signal_in_the_last_step_still_exports(small_dataset, tmp_path, signal_at, exported):
    """The run reached train.steps and saved it: it is complete and exported. A signal that ends it
    before train.steps leaves a checkpoint to resume from and no export."""
    run_dir = tmp_path / "run"
    trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, run_dir, 2, **{"checkpoint.export_hf": True})))
    _stop_signal_after(trainer, signal_at)
    result = trainer.train()
    assert (result.stopped_by_signal, result.last_step) == (signal.SIGTERM, signal_at)
    assert result.checkpoint == run_dir / "checkpoints" / f"step_{signal_at:08d}"
    assert result.written == (run_dir / "hf" if exported else None)
    assert (run_dir / "hf" / "model.safetensors").is_file() == exported


def test_an_empty_export_directory_is_refused():
    with pytest.raises(ConfigError, match="checkpoint.export_hf_dir.*non-empty path"):
        load_config(TINY_MOE, ["checkpoint.export_hf_dir=''"])


def test_bf16_export_keeps_the_routing_bias_fp32(tmp_path):
    """DeepSeek-V3's aux-loss-free routing bias stays fp32 in a bf16 export, bit for bit, as in a
    model loaded in bf16 and in transformers (which keeps e_score_correction_bias fp32)."""
    from transformers import AutoModelForCausalLM

    model = Transformer(get_preset("tiny-deepseek"), init_seed=0)
    bias = model.get_buffer("layers.1.moe.router.expert_bias")
    bias.copy_(1 + torch.arange(bias.numel()) / 3)  # thirds: bf16 would round every one of them
    assert not torch.equal(bias.bfloat16().float(), bias)
    root = save_model_checkpoint(model, tmp_path / "ckpt")
    export_checkpoint_to_hf(root, tmp_path / "streamed", dtype=torch.bfloat16)
    hf_key = "model.layers.1.mlp.gate.e_score_correction_bias"
    written = load_file(tmp_path / "streamed" / "model.safetensors")
    assert written[hf_key].dtype == torch.float32 and torch.equal(written[hf_key], bias)
    assert written["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    loaded, _ = load_tessera_model(root, dtype=torch.bfloat16)
    assert torch.equal(loaded.get_buffer("layers.1.moe.router.expert_bias"), bias)
    save_pretrained(loaded, tmp_path / "whole")
    _same_directories(tmp_path / "streamed", tmp_path / "whole")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed", torch_dtype=torch.bfloat16)
    gate = hf.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and torch.equal(gate.e_score_correction_bias, bias)
