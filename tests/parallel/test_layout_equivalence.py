"""The acceptance bar: one training step and a second forward under each layout give the same
losses, gradient norm, gradients and updated weights as one process on the same global batch
(fp32, 1e-5 relative). Each data-parallel rank computes sum(token losses) / N_global and
gradients are summed across ranks."""

import dataclasses

import pytest

from tessera.config import get_preset
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import assert_same_step, layout_step, reference_step

_refs: dict = {}


def reference(preset: str, micro_batches: int, overrides: dict | None = None) -> dict:
    key = (preset, micro_batches, repr(overrides))
    if key not in _refs:
        _refs[key] = reference_step(preset, micro_batches, overrides)
    return _refs[key]


LAYOUTS = [
    # (preset, parallel config, world size, micro-batches of the reference = dp x per-rank)
    pytest.param("tiny-llama", dict(dp_shard=2), 2, 2, id="llama-fsdp2"),
    pytest.param("tiny-llama", dict(dp_replicate=2, dp_shard=1), 2, 2, id="llama-replicate2"),
    pytest.param("tiny-llama", dict(tp=2, dp_shard=1), 2, 1, id="llama-tp2"),
    pytest.param("tiny-llama", dict(tp=2, sp=True, dp_shard=1), 2, 1, id="llama-tp2-sp"),
    pytest.param("tiny-moe", dict(dp_shard=2), 2, 2, id="moe-fsdp2"),
    pytest.param("tiny-moe", dict(tp=2, dp_shard=1), 2, 1, id="moe-tp2"),
    pytest.param("tiny-moe", dict(tp=2, sp=True, dp_shard=1), 2, 1, id="moe-tp2-sp"),
    pytest.param("tiny-moe", dict(ep=2, dp_shard=2), 2, 2, id="moe-ep2-fsdp2"),
    pytest.param("tiny-glm4-moe", dict(ep=2, dp_shard=2), 2, 2, id="glm4-moe-ep2-fsdp2"),
    pytest.param("tiny-glm4-moe", dict(tp=2, sp=True, dp_shard=1), 2, 1, id="glm4-moe-tp2-sp"),
    pytest.param("tiny-gpt-oss", dict(ep=2, dp_shard=2), 2, 2, id="gpt-oss-ep2-fsdp2"),
    pytest.param("tiny-gpt-oss", dict(tp=2, sp=True, dp_shard=1), 2, 1, id="gpt-oss-tp2-sp"),
    pytest.param("tiny-llama", dict(tp=2, dp_shard=2), 4, 2, id="llama-tp2-fsdp2"),
    # Recomputation inside sharded / communicating blocks must not change anything.
    pytest.param("tiny-moe", dict(ep=2, dp_shard=2, recompute="full"), 2, 2, id="moe-ep2-recompute-full"),
    pytest.param("tiny-llama", dict(tp=2, sp=True, dp_shard=1, recompute="selective"), 2, 1,
                 id="llama-tp2-sp-recompute-selective"),
    # Operator-level policies (torchtitan's; DeepSeek-V3's save list on every 2nd layer) under expert and
    # tensor parallelism: the policy's replay must re-run the same collectives and products.
    pytest.param("tiny-moe", dict(ep=2, dp_shard=2, recompute="op"), 2, 2, id="moe-ep2-recompute-op"),
    pytest.param("tiny-llama", dict(tp=2, sp=True, dp_shard=1, recompute="op", recompute_interval=2,
                                    recompute_save=["attention_core", "attention_in", "router", "mlp_in"]), 2, 1,
                 id="llama-tp2-sp-recompute-op-deepseek-every-2nd"),
]


@pytest.mark.dist
@pytest.mark.parametrize("preset,parallel,world,micro", LAYOUTS)
def test_layout_matches_single_process(preset, parallel, world, micro):
    got = run_ranks(layout_step, world, preset, parallel)
    assert_same_step(got[0], reference(preset, micro))
    assert all(r["loss1"] == got[0]["loss1"] and r["norm"] == got[0]["norm"] for r in got)


@pytest.mark.dist
def test_two_micro_batches_per_rank_match():
    # Gradient accumulation inside each data-parallel rank: 2 ranks x 2 micro-batches.
    got = run_ranks(layout_step, 2, "tiny-moe", dict(dp_shard=2), micro_per_rank=2)
    assert_same_step(got[0], reference("tiny-moe", 4))


@pytest.mark.dist
def test_allgather_expert_dispatcher_matches():
    got = run_ranks(layout_step, 2, "tiny-moe", dict(ep=2, dp_shard=2, ep_dispatcher="allgather"))
    assert_same_step(got[0], reference("tiny-moe", 2))


def _rich_moe() -> dict:
    # Shared experts with a gate (Qwen2-MoE), QK-norm (Qwen3) and capacity-based dropping: the
    # plan entries and dispatcher paths the presets above do not reach.
    moe = dataclasses.replace(get_preset("tiny-moe").moe, shared_ffn_dim=64, shared_expert_gate=True,
                              capacity_factor=1.0)
    return {"qk_norm": True, "moe": moe}


@pytest.mark.dist
def test_tp_sp_with_shared_experts_qk_norm_and_capacity():
    got = run_ranks(layout_step, 2, "tiny-moe", dict(tp=2, sp=True, dp_shard=1), config_overrides=_rich_moe())
    assert_same_step(got[0], reference("tiny-moe", 1, _rich_moe()))


@pytest.mark.dist
def test_ep_with_padded_capacity():
    over = {"moe": dataclasses.replace(get_preset("tiny-moe").moe, capacity_factor=1.0, pad_to_capacity=True)}
    got = run_ranks(layout_step, 2, "tiny-moe", dict(ep=2, dp_shard=2), config_overrides=over)
    assert_same_step(got[0], reference("tiny-moe", 2, over))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("parallel", [
    pytest.param(dict(ep=2, dp_shard=2, tp=2), id="ep2-tp2"),
    pytest.param(dict(dp_replicate=2, dp_shard=2, ep=2), id="hsdp-ep2"),
    pytest.param(dict(dp_shard=4, ep=2), id="fsdp4-ep2"),  # expert weights also FSDP-sharded
])
def test_four_rank_moe_layouts(parallel):
    got = run_ranks(layout_step, 4, "tiny-moe", parallel)
    dp = parallel.get("dp_replicate", 1) * parallel["dp_shard"]
    assert_same_step(got[0], reference("tiny-moe", dp))


def _llama4() -> dict:
    # Llama 4's parts: chunks on the rotated layer 0, temperature tuning on the NoPE layer 1, the weightless
    # QK norm, and one sigmoid gate scaling the token into its expert beside a shared expert.
    moe = dataclasses.replace(get_preset("tiny-moe").moe, top_k=1, score_func="sigmoid", norm_topk_prob=False,
                              gate_input=True, shared_ffn_dim=64)
    return {"moe": moe, "attention_chunk_size": 5, "nope_layers": [1], "qk_l2_norm": True, "nope_attn_scale": 0.5,
            "nope_floor_scale": 4}


@pytest.mark.dist
@pytest.mark.parametrize("parallel,micro", [(dict(ep=2, dp_shard=2), 2), (dict(tp=2, sp=True, dp_shard=1), 1)],
                         ids=["ep2-fsdp2", "tp2-sp"])
def test_llama4_parts_under_ep_and_tp_sp(parallel, micro):
    got = run_ranks(layout_step, 2, "tiny-moe", parallel, config_overrides=_llama4())
    assert_same_step(got[0], reference("tiny-moe", micro, _llama4()))
