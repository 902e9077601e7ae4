"""GRPO's shared-prefix update rows (tessera/train/modes/grpo_packing.py,
tessera/models/attention_variants/shared_prefix.py): a group in one row, its prompt computed once
and each completion attending to it, gives one step's loss, figures and gradients equal to one row
per completion (fp32 1e-5), for a dense model, an MoE and DeepSeek's latent attention with its MoE,
with prompts and completions of different lengths, padding, two micro-batches, a reference (KL),
temperature, entropy and the bitwise scoring pass; the row it runs holds fewer tokens. What it
cannot serve falls back to per-completion rows, said in the run's start-up lines: the switch off, a
capacity-limited MoE (trained exactly as rows), recurrent and sparse latent-attention families."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessera.config.schema import load_config
from tessera.models.attention_variants.shared_prefix import shared_prefix_refusal
from tessera.train.trainer import Trainer
from tests.infer.tiny_models import save_tokenizer
from tests.train.runs import TINY_DEEPSEEK, TINY_DENSE, TINY_MOE
from tests.train.test_grpo_train import FixedRollouts, _overrides

PROMPTS = ["Hi", "Say a number after cat", "Add two and three please", "Count to five"]  # different lengths
SETTINGS = {"train.grpo.group_size": 3, "train.grpo.temperature": 0.7, "train.grpo.kl_coef": 0.1,
            "train.grpo.entropy_coef": 0.01, "train.grpo.tis_cap": 1.5}
MOE = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.ffn_dim": 64}
# the load-balancing and z losses are over the tokens a forward routes: the rows route each prompt
# group_size times and their padding too, the shared rows each prompt token once; without them the
# objective is the policy gradient's alone, which the two layouts must give alike
NO_AUX = {"model.moe.aux_loss_coef": 0.0, "model.moe.z_loss_coef": 0.0}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo-shared")
    save_tokenizer(root / "tok")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": 1}) + "\n" for p in PROMPTS))
    return root


def _step(root: Path, run: str, config: str, **extra) -> tuple[Trainer, object, list[int]]:
    """One forward_backward on fixed rollouts; the trainer, its result and the token count of each
    input the policy's forward was given."""
    cfg = load_config(config, _overrides(root, run, **{**SETTINGS, **extra}))
    trainer = Trainer(cfg, rollouts=FixedRollouts(cfg.train.grpo.group_size))
    with torch.no_grad():  # the policy moved off its reference, as after some steps: the KL is not 0
        generator = torch.Generator().manual_seed(5)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    fed: list[int] = []
    hook = trainer.model.register_forward_pre_hook(lambda module, args: fed.append(args[0].tokens.numel()))
    result = trainer.engine.forward_backward(trainer.data.train.next_batch())
    hook.remove()
    return trainer, result, fed


def _assert_same_step(got: tuple, want: tuple) -> None:
    (trainer, result, _), (ref_trainer, ref, _) = got, want
    assert result.loss == pytest.approx(ref.loss, rel=1e-5, abs=1e-7)
    assert result.loss_tokens == ref.loss_tokens and result.tokens == ref.tokens
    for key, value in ref.scalars.items():
        if key != "rollout_tokens_per_s":
            assert result.scalars[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert ref.scalars["kl"] > 1e-6  # the reference's path is exercised
    grads = dict(ref_trainer.model.named_parameters())
    for name, p in trainer.model.named_parameters():
        g = grads[name].grad
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("config,extra", [
    pytest.param(TINY_DENSE, {}, id="dense"),
    pytest.param(TINY_DENSE, {"train.grpo.bitwise": True, "train.grpo.loss_averaging": "sequence"},
                 id="dense-bitwise-sequence"),
    pytest.param(TINY_MOE, {**MOE, **NO_AUX}, id="moe"),
    pytest.param(TINY_DEEPSEEK, {"model.moe.seq_aux_loss_coef": 0.0}, id="latent-attention-moe"),
])
def test_one_step_on_shared_prefix_rows_equals_one_row_per_completion(root, config, extra):
    shared = _step(root, "shared", config, **extra)
    rows = _step(root, "rows", config, **{**extra, "train.grpo.shared_prefix": False})
    assert shared[0].engine.rows_refusal is None
    assert rows[0].engine.rows_refusal == "train.grpo.shared_prefix=false"
    _assert_same_step(shared, rows)
    # two micro-batches a step; the policy (and the reference, with the bitwise pass the policy twice
    # more) saw each prompt once per group in the shared rows, group_size times in the per-completion rows
    assert len(shared[2]) == len(rows[2]) and sum(shared[2]) < sum(rows[2]) / 2, (shared[2], rows[2])


def test_with_moe_auxiliary_losses_only_they_differ_between_the_layouts(root):
    shared, rows = _step(root, "aux", TINY_MOE, **MOE)[1], _step(root, "aux-rows", TINY_MOE, **{
        **MOE, "train.grpo.shared_prefix": False})[1]
    assert shared.loss == pytest.approx(rows.loss, rel=1e-5, abs=1e-7)
    assert shared.aux_loss > 0 and rows.aux_loss > 0 and shared.aux_loss != rows.aux_loss


def test_a_capacity_limited_moe_falls_back_to_per_completion_rows_and_says_why(root):
    capacity = {**MOE, "model.moe.capacity_factor": 1.0}
    fallback = _step(root, "capacity", TINY_MOE, **capacity)
    rows = _step(root, "capacity-rows", TINY_MOE, **{**capacity, "train.grpo.shared_prefix": False})
    reason = fallback[0].engine.rows_refusal
    assert reason.startswith("model.moe.capacity_factor=1 drops tokens by what shares the batch")
    assert fallback[2] == rows[2]  # the same rows
    assert fallback[1].loss == rows[1].loss
    lines = "\n".join(fallback[0].built.summary(0))
    assert f"update rows: one per completion (shared-prefix rows refused: {reason})" in lines
    assert "update rows: shared-prefix" in "\n".join(_step(root, "lines", TINY_MOE, **MOE)[0].built.summary(0))


def test_recurrent_and_sparse_latent_attention_families_are_refused_by_name():
    hybrid = load_config(TINY_DENSE, ["model.linear_attention={layers: [0], n_key_heads: 2, n_value_heads: 4, "
                                      "key_head_dim: 16, value_head_dim: 16}"]).model
    assert shared_prefix_refusal(hybrid) == ("its linear-attention or Mamba layers carry a recurrent state "
                                             "through the row, not a per-key mask")
    sparse = load_config(TINY_DEEPSEEK, ["model.mla.index_topk=4", "model.mla.index_n_heads=2",
                                         "model.mla.index_head_dim=16"]).model
    assert shared_prefix_refusal(sparse).startswith("sparse latent attention (mla.index_topk) picks its keys")
    dense = load_config(TINY_DENSE, []).model
    assert shared_prefix_refusal(dense) is None
    assert shared_prefix_refusal(dense, [16, 24, 24]).startswith("multimodal RoPE places tokens by (t, h, w)")
