"""Hidden-state matching (train.distill.hidden_layers): the logged distill_hidden_loss equals a hand
computation (the teacher's block outputs from transformers' hidden_states, the student's by running
its blocks, the projection's initial draw), the term reaches the gradient and the projections
train but stay out of the student's checkpoint and export, and bad keys or layouts are refused by name."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.models.rope import rope_cos_sin
from tessera.train.data_source import build_training_data
from tessera.train.objectives.hidden_match import SEED_OFFSET
from tessera.train.run.rng_state import seed_everything
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, shrink

TEACHER = {"model.dim": 96, "model.ffn_dim": 192, "model.n_layers": 3, "checkpoint.export_hf": True}
PAIRS = [[0, 0], [1, 1]]


@pytest.fixture(scope="module")
def teacher(small_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("teacher")
    Trainer(load_config(TINY_DENSE, shrink(small_dataset, run, 2, **TEACHER))).train()
    return run


def _student_block_outputs(model: Transformer, inputs: torch.Tensor) -> list[torch.Tensor]:
    """Every block's output, running the blocks one by one (what the student's forward does)."""
    h = model.tok_embeddings(inputs)
    positions = torch.arange(inputs.shape[1]).expand(inputs.shape[0], -1)
    cos, sin = rope_cos_sin(positions, model.rope_inv_freq, model.rope_attention_factor, h.dtype)
    out = []
    for layer in model.layers.values():
        h, _ = layer(h, cos, sin)
        out.append(h)
    return out


def test_hidden_loss_equals_a_hand_computation_and_trains_the_projections(teacher, small_dataset, tmp_path):
    overrides = shrink(small_dataset, tmp_path / "run", 2, **{
        "train.distill.teacher": teacher / "hf", "train.distill.hidden_layers": PAIRS,
        "train.distill.hidden_weight": 0.7, "checkpoint.export_hf": True})
    cfg = load_config(TINY_DENSE, overrides)
    trainer = Trainer(cfg)
    projections = {k: v.weight.detach().clone() for k, v in trainer.engine.distiller.hidden.projections.items()}
    records = trainer.train().records

    seed_everything(cfg.train.seed)
    batch = build_training_data(cfg).train.next_batch()
    student = Transformer(cfg.model, init_seed=cfg.train.seed)
    hf_teacher = AutoModelForCausalLM.from_pretrained(teacher / "hf", torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(cfg.train.seed + SEED_OFFSET)
    keep = batch.target_mask.bool()
    with torch.no_grad():
        mine = _student_block_outputs(student, batch.inputs)
        # transformers: hidden_states[0] is the embedding, [j + 1] block j's output (the last one normed)
        theirs = hf_teacher(batch.inputs, output_hidden_states=True).hidden_states
        total = 0.0
        for i, j in PAIRS:
            w = torch.randn(96, 64, generator=gen) / math.sqrt(64)
            assert torch.equal(w, projections[f"{i}_{j}"])
            diff = mine[i][keep] @ w.T - theirs[j + 1][keep]
            total += float((diff ** 2).mean(dim=-1).sum())
    n = int(keep.sum())
    first = records[0]
    assert first["distill_hidden_loss"] == pytest.approx(total / n, rel=1e-5)
    assert first["distill_hidden_loss"] > 0 and "distill_loss" in first

    trained = trainer.engine.distiller.hidden.projections
    assert all(not torch.equal(trained[k].weight, w) for k, w in projections.items())  # they train
    assert not any("projection" in name for name in trainer.model.state_dict())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")  # the student alone
    assert sum(p.numel() for p in exported.parameters()) == sum(p.numel() for p in trainer.model.parameters())


def test_the_hidden_term_reaches_the_gradient(teacher, small_dataset, tmp_path):
    def run(name: str, weight: float) -> list[dict]:
        return Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / name, 2, **{
            "train.distill.teacher": teacher, "train.distill.hidden_layers": PAIRS,
            "train.distill.hidden_weight": weight}))).train().records

    off, on = run("off", 0.0), run("on", 1.0)
    assert off[0]["loss"] == on[0]["loss"] and off[0]["distill_hidden_loss"] == on[0]["distill_hidden_loss"]
    assert off[0]["grad_norm"] != on[0]["grad_norm"]


@pytest.mark.parametrize("extra,key,allowed", [
    ({"train.distill.hidden_layers": [[2, 0]]}, "train.distill.hidden_layers", "student layer in 0..1"),
    ({"train.distill.hidden_layers": [[0, 0]], "parallel.tp": 2}, "parallel.tp", "1 with train.distill.hidden_layers"),
    ({"train.distill.hidden_layers": [[0, 0]], "parallel.pp": 2}, "parallel.pp", "1 with train.distill.hidden_layers"),
    ({"train.distill.hidden_layers": [[0, 0]], "parallel.cp": 2}, "parallel.cp", "1 with train.distill.hidden_layers"),
    ({"train.distill.hidden_layers": [[0, 0]], "train.dtype": "fp16"}, "train.dtype", "fp32 or bf16"),
    ({"train.distill.hidden_weight": -1}, "train.distill.hidden_weight", "must be >= 0"),
    ({"train.distill.hidden_layers": [[0]]}, "train.distill.hidden_layers", "expected a list of 2 values"),
])
def test_hidden_matching_keys_and_layouts_are_checked(extra, key, allowed, small_dataset, tmp_path):
    overrides = shrink(small_dataset, tmp_path, 1, **{"train.distill.teacher": "/some/teacher", **extra})
    with pytest.raises(ConfigError) as e:
        load_config(TINY_DENSE, overrides)
    assert key in str(e.value) and allowed in str(e.value), str(e.value)


def test_hidden_layers_need_a_teacher_and_teacher_layers_it_has(teacher, small_dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"train.distill.hidden_layers=\[\[0, 0\]\].*empty without"):
        load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "a", 1, **{"train.distill.hidden_layers": [[0, 0]]}))
    cfg = load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "b", 1, **{
        "train.distill.teacher": teacher, "train.distill.hidden_layers": [[0, 3]]}))
    with pytest.raises(ConfigError, match=r"\[\[0, 3\]\] name teacher layers the teacher .* has 3 \(0..2\)"):
        Trainer(cfg)
