"""A HuggingFace export of a checkpoint saved under a parallel layout equals the export of the
one-process run: after the same two steps, transformers computes the same logits from both.

The tp=2 x ep=2 MoE run exports itself at the end (checkpoint.export_hf: rank 0 reads the
checkpoint the four ranks wrote while the others wait); the pipeline run is converted afterwards
with `tessera convert RUN_DIR DST`. Neither builds the whole model: each safetensors file's
tensors are read from the ranks' shards (tessera.checkpoint.hf.export).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.checkpoint.dcp import store as ckpt
from tessera.cli import main
from tessera.data.tokenizer import default_tokenizer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import overrides_for, train_on_ranks, train_one_process

STEPS = 2
EXPORT = {"checkpoint.export_hf": True}


def _logits(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([default_tokenizer().encode("class Encoder(object):\n    def encode(self, o):")])
    with torch.no_grad():
        return model(ids).logits


def _reference(model: str, dataset: str, run_dir: Path) -> torch.Tensor:
    train_one_process(model, overrides_for(model, dataset, run_dir, STEPS, **EXPORT))
    return _logits(run_dir / "hf")


def _written_by(run_dir: Path, world: int) -> None:
    """The checkpoint is the layout's: every rank wrote its own shard file."""
    found = ckpt.resolve_checkpoint(run_dir)
    assert ckpt.read_meta(found)["layout"]["world_size"] == world
    assert len([p for p in found.iterdir() if p.suffix == ".distcp"]) == world


@pytest.mark.dist
def test_tp2_ep2_run_exports_itself_like_one_process(small_dataset, tmp_path):
    want = _reference("moe", small_dataset, tmp_path / "one")
    run = tmp_path / "tp2-ep2"
    parallel = {"parallel.tp": 2, "parallel.ep": 2, "parallel.dp_shard": 2}
    run_ranks(train_on_ranks, 4, "moe", overrides_for("moe", small_dataset, run, STEPS, **EXPORT, **parallel))
    _written_by(run, 4)
    torch.testing.assert_close(_logits(run / "hf"), want, rtol=1e-4, atol=1e-4)


@pytest.mark.dist
def test_pipeline_checkpoint_converts_like_one_process(small_dataset, tmp_path, capsys):
    want = _reference("dense", small_dataset, tmp_path / "one")
    run = tmp_path / "pp2"
    run_ranks(train_on_ranks, 2, "dense",
              overrides_for("dense", small_dataset, run, STEPS, **{"parallel.pp": 2, "parallel.dp_shard": 1}))
    _written_by(run, 2)
    assert not (run / "hf").exists()  # checkpoint.export_hf is off by default
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    assert "wrote huggingface directory" in capsys.readouterr().out
    torch.testing.assert_close(_logits(tmp_path / "hf"), want, rtol=1e-4, atol=1e-4)
