"""GRPO's serving engine and its trainer agree on the fp32 log-probabilities of the sampled tokens to
less than 1e-6 on average by default (train.grpo.fp64_attention: both attend in float64 and round
back, so neither's order of sums shows), where attending in fp32 they differ by more (the engine's
decode attends one query over its cache, the trainer's causal SDPA whole rows, and each rounds its
own way); the bitwise mode stays exactly 0. The model's random weights (std 0.3, four layers) make
attention and logits as peaked as a trained model's, where the fp32 difference exceeds 1e-6 (it does
on SmolLM2-135M: docs/benchmarks.md); at the usual tiny std it stays far below. The update runs its
shared-prefix rows (the default, train.grpo.shared_prefix), whose attention goes through the
SharedPrefixMask rather than the policy's attention core: it attends in float64 too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config.schema import load_config
from tessera.eval.rollouts import EngineRollouts
from tessera.models.attention import Attention, causal_attention, wide_causal_attention
from tessera.train.trainer import Trainer
from tests.infer.tiny_models import write_model
from tests.train.test_grpo_train import _records, grpo_root


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = grpo_root(tmp_path_factory)
    write_model(root / "hf", std=0.3, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    return root


def _run(root: Path, run: str, **extra: object) -> tuple[list[dict], Trainer, EngineRollouts]:
    values: dict[str, object] = {
        "run_dir": root / run, "train.device": "cpu", "train.init_from": root / "hf", "data.tokenizer": root / "hf",
        "train.seq_len": 48, "train.micro_batch_size": 2, "train.global_batch_size": 4, "train.steps": 2,
        "train.log_interval": 1, "train.eval_interval": 0, "optim.warmup_steps": 0, "optim.lr": 1e-3,
        "optim.schedule": "constant", "checkpoint.interval": 0, "log.tensorboard": "false",
        "log.progress_bar": "false", "data.kind": "prompts", "train.objective": "grpo",
        "data.datasets": f"[{{path: {root / 'prompts.jsonl'}}}]", "train.grpo.reward": "regex_format",
        "train.grpo.format_pattern": r"'\d.*'", "train.grpo.max_new_tokens": 8, **extra}
    cfg = load_config(None, [f"{k}={v}" for k, v in values.items()])
    rollouts = EngineRollouts(cfg)
    trainer = Trainer(cfg, rollouts=rollouts)
    trainer.train()
    return _records(root / run), trainer, rollouts


def _cores(trainer: Trainer) -> set:
    """The policy's attention cores, each inside any recomputation wrapper (`inner`)."""
    def inside(core):
        return inside(core.inner) if hasattr(core, "inner") else core
    return {inside(m.attention_core) for m in trainer.model.modules() if isinstance(m, Attention)}


def test_the_engines_fp32_log_probabilities_agree_with_the_trainers_to_below_1e_6_on_average(root):
    wide, trainer, rollouts = _run(root, "fp64-attention")
    narrow, narrow_trainer, narrow_rollouts = _run(root, "fp32-attention", **{"train.grpo.fp64_attention": "false"})
    assert _cores(trainer) == {wide_causal_attention} and rollouts.config(4).fp64_attention
    assert trainer.engine.rows_refusal is None  # the update ran shared-prefix rows (the default), in float64 too
    assert trainer.engine.attention_dtype == torch.float64 and narrow_trainer.engine.attention_dtype is None
    assert _cores(narrow_trainer) == {causal_attention} and not narrow_rollouts.config(4).fp64_attention
    tokens = sum(r["response_length"] * 16 for r in wide)  # 4 prompts x 4 completions a step
    assert tokens >= 48, wide  # a few dozen sampled tokens scored both ways
    for r in wide:
        assert r["logprob_diff_mean"] < 1e-6, r
    # attending in fp32 the two differ by more: what the float64 sums remove
    assert max(r["logprob_diff_mean"] for r in narrow) > 1e-6, narrow
    assert wide[0]["response_length"] == narrow[0]["response_length"]  # the first step samples the same tokens


def test_the_bitwise_mode_stays_exact_and_attends_in_fp32(root):
    records, trainer, rollouts = _run(root, "bitwise", **{"train.grpo.bitwise": "true"})
    assert _cores(trainer) == {causal_attention} and not rollouts.config(4).fp64_attention
    for r in records:
        assert r["logprob_diff_max"] == 0 and r["logprob_diff_mean"] == 0, r


@pytest.mark.parametrize("extra", [
    pytest.param({"train.grpo.shared_prefix": "false"}, id="one-row-per-completion"),
    pytest.param({"train.grpo.shared_prefix": "false", "parallel.recompute": "selective"}, id="selective-recompute"),
])
def test_the_update_without_shared_prefix_rows_or_with_a_wrapped_core_agrees_too(root, extra):
    """One row per completion (the policy's attention core, not the mask) and a core wrapped by
    selective recomputation (the float64 core goes inside the wrapper) agree to below 1e-6 as well."""
    name = "-".join(extra).replace(".", "_")
    records, trainer, _ = _run(root, name, **extra)
    assert _cores(trainer) == {wide_causal_attention}
    assert trainer.engine.rows_refusal == "train.grpo.shared_prefix=false"  # the core scores, not the mask
    for r in records:
        assert r["logprob_diff_mean"] < 1e-6, r
