"""Model-state memory: the published ZeRO and Megatron figures, and exact bytes of a real model and
a real `torch.optim.AdamW` after one step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.config import get_preset
from tessera.config.errors import ConfigError
from tessera.models import Transformer
from tessera.models.counting import count_params
from tessera.plan.layout import Layout, stage_layers
from tessera.plan.memory import (
    PRECISIONS,
    get_precision,
    layer_rank_params,
    model_state_bytes,
    rank_params,
    zero_model_state_bytes,
)


@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figures(stage, gb):
    """Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054), figure 1: a 7.5B-parameter model on 64
    GPUs with mixed-precision Adam (K = 12) needs 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per GPU
    under stages 0 to 3. 16-bit weights and gradients: our `bf16-lowp-grads` precision."""
    states = zero_model_state_bytes(7.5e9, 64, stage, get_precision("bf16-lowp-grads"))
    assert round(states.total / 1e9, 1) == gb


def test_megatron_accounting():
    """Megatron-LM's bf16 training with fp32 gradient buffers: 18 bytes per parameter, and
    6 + 12/d with the distributed optimizer (ZeRO-1 over d ranks): our `bf16` precision."""
    p = get_precision("bf16")
    assert zero_model_state_bytes(1.0, 1, 0, p).total == 18
    for d in (2, 8, 64):
        assert zero_model_state_bytes(1.0, d, 1, p).total == pytest.approx(6 + 12 / d)


def test_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="fp32"):
        get_precision("fp8")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-deepseek", "qwen3-30b-a3b", "deepseek-v3"])
def test_one_rank_holds_every_parameter(name):
    cfg = get_preset(name)
    (only,) = rank_params(cfg, Layout())
    assert only.total == count_params(cfg)


def test_tensor_and_expert_parallel_cut_what_they_should():
    """Heads, FFN columns and vocabulary are cut by tp; norms and the router stay whole; experts
    are split over ep. So tp x (rank params) = total + (tp-1) x replicated params."""
    cfg = get_preset("mixtral-8x7b")
    tp, ep = 8, 4
    dense, expert = layer_rank_params(cfg, 0, tp, ep)
    replicated = 2 * cfg.dim + cfg.moe.num_experts * cfg.dim  # two norms + the router
    full_dense, full_expert = layer_rank_params(cfg, 0, 1, 1)
    assert tp * dense == pytest.approx(full_dense + (tp - 1) * replicated)
    assert expert * tp * ep == pytest.approx(full_expert)


@pytest.mark.parametrize("name,pp", [("tiny-deepseek", 2), ("tiny-deepseek", 3), ("tiny-moe", 2)])
def test_pipeline_stages_hold_the_parameters_of_their_layers(name, pp):
    """Per-stage counts against the real model's parameters, grouped by the names a stage keeps
    (layers.<i>. for its layers, the embedding on the first stage, norm + head on the last)."""
    cfg = get_preset(name)
    model = Transformer(cfg)
    stages = stage_layers(cfg.n_layers, pp)
    for s, got in enumerate(rank_params(cfg, Layout(pp=pp))):
        keep = {f"layers.{i}." for i in stages[s]}
        want = 0
        for n, p in model.named_parameters():
            if any(n.startswith(k) for k in keep) or (s == 0 and n.startswith("tok_embeddings")) or (
                    s == pp - 1 and (n.startswith("norm.") or n.startswith("output."))):
                want += p.numel()
        assert got.total == want, (s, stages[s])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-deepseek"])
def test_model_states_match_a_real_model_and_adamw_exactly(name):
    """fp32 training on one process: weights 4N, gradients 4N, AdamW's exp_avg + exp_avg_sq 8N,
    byte for byte (AdamW's per-tensor `step` scalars are left out, as documented)."""
    cfg = get_preset(name)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(ids)
    (out.logits.float().square().mean() + out.aux_loss).backward()
    opt.step()
    (rank,) = rank_params(cfg, Layout())
    states = model_state_bytes(rank, Layout(), get_precision("fp32"))
    params = list(model.parameters())
    assert states.weights == sum(p.numel() * p.element_size() for p in params)
    assert states.gradients == sum(p.grad.numel() * p.grad.element_size() for p in params)
    moments = sum(st[k].numel() * st[k].element_size() for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert states.optimizer == moments
    assert states.master == 0 and states.gathered == 0


def test_bf16_weights_and_gradients_are_two_bytes():
    cfg = get_preset("tiny-moe")
    model = Transformer(cfg).to(torch.bfloat16)
    out = model(torch.randint(0, cfg.vocab_size, (1, 8)))
    out.logits.float().sum().backward()
    (rank,) = rank_params(cfg, Layout())
    states = model_state_bytes(rank, Layout(), get_precision("bf16-lowp-grads"))
    assert states.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    assert states.gradients == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())


def test_zero_stages_shard_what_they_say_over_dp_shard_times_cp():
    cfg = get_preset("llama3-8b")
    p = PRECISIONS["bf16"]
    base = Layout(dp_shard=16, cp=2)
    (rank,) = rank_params(cfg, base)
    n = rank.total
    d = 32
    s1 = model_state_bytes(rank, dataclasses.replace(base, zero_stage=1), p)
    s2 = model_state_bytes(rank, dataclasses.replace(base, zero_stage=2), p)
    s3 = model_state_bytes(rank, dataclasses.replace(base, zero_stage=3), p)
    assert (s1.weights, s1.gradients, s1.optimizer) == (2 * n, 4 * n, pytest.approx(8 * n / d))
    assert (s2.weights, s2.gradients) == (2 * n, pytest.approx(4 * n / d))
    assert s3.weights == pytest.approx(2 * n / d) and s3.gathered > 0
    replicated = model_state_bytes(rank, Layout(dp_replicate=32, zero_stage=3), p)
    assert replicated.total == pytest.approx(18 * n)  # nothing to shard over: plain data parallelism


def test_experts_shard_over_what_ep_leaves_of_dp_shard():
    cfg = get_preset("mixtral-8x7b")
    lay = Layout(dp_shard=8, ep=8, zero_stage=1)
    (rank,) = rank_params(cfg, lay)
    states = model_state_bytes(rank, lay, get_precision("bf16"))
    # Experts: split 8 ways by ep, not sharded further (dp_shard x cp / ep = 1); dense: sharded 8 ways.
    assert states.optimizer == pytest.approx(8 * rank.dense / 8 + 8 * rank.expert)


def test_sharding_choices_follow_the_zero_paper():
    """The table `tessera plan` prints: for the 7.5B-parameter example of the ZeRO paper on 64
    data-parallel ranks, 120 / 31.4 / 16.6 / 1.9 GB (plus, at stage 3, the gather buffers)."""
    from tessera.plan.memory import RankParams, sharding_choices

    params = RankParams(dense=7.5e9, expert=0.0, largest_unit=7.5e9 / 32)
    choices = sharding_choices(params, Layout(dp_shard=64), get_precision("bf16-lowp-grads"))
    got = [round(choices[k].total / 1e9, 1) for k in ("replicated", "zero1", "zero2")]
    assert got == [120.0, 31.4, 16.6]
    assert round((choices["zero3"].total - choices["zero3"].gathered) / 1e9, 1) == 1.9
