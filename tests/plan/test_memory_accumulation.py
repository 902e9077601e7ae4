"""Gradient memory under accumulation, as the trainer runs it: FSDP2 syncs gradients only in the
step's last micro-batch (tests/parallel/test_gradient_accumulation_sync.py), so until then every
sharded parameter holds its whole gradient; the plan counts that, and the README's LLaMA-3 8B
plan reports it."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.config import get_preset
from tessera.plan.cluster import Cluster
from tessera.plan.estimate import make_plan
from tessera.plan.layout import Layout, Workload
from tessera.plan.memory import get_precision, model_state_bytes, rank_params


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_gradients_are_unsharded_while_micro_batches_accumulate(zero_stage):
    cfg = get_preset("mixtral-8x7b")
    lay = Layout(dp_shard=8, ep=4, zero_stage=zero_stage)
    params = rank_params(cfg, lay)[0]
    precision = get_precision("bf16")
    one = model_state_bytes(params, lay, precision, microbatches=1)
    if zero_stage >= 2:  # ZeRO-1 as the paper defines it keeps whole gradients anyway
        assert one.gradients == pytest.approx(4 * (params.dense / 8 + params.expert / 2))  # sharded
    several = model_state_bytes(params, lay, precision, microbatches=4)
    assert several.gradients == pytest.approx(4 * params.total)  # whole, until the last micro-batch
    assert dataclasses.replace(several, gradients=one.gradients) == one  # nothing else changes


def test_unsharded_gradients_are_not_counted_twice_without_sharding():
    cfg = get_preset("llama3-8b")
    params = rank_params(cfg, Layout(dp_replicate=8))[0]
    lay = Layout(dp_replicate=8, dp_shard=1)
    precision = get_precision("bf16")
    assert model_state_bytes(params, lay, precision, 8) == model_state_bytes(params, lay, precision, 1)


def test_llama3_8b_plan_counts_the_accumulated_gradients():
    """configs/llama3-8b.yaml on 64 GPUs: tp=2 x ZeRO-3 over 32, 16 micro-batches per step: 15 GiB of
    unsharded fp32 gradients (the rank's 4.0 B parameters), not 0.47 GiB."""
    cfg = get_preset("llama3-8b")
    lay = Layout(tp=2, sp=True, dp_shard=32, recompute="selective")
    plan = make_plan(cfg, lay, Workload(8192, 1, 512), Cluster(gpus=64), precision="bf16")
    assert plan.microbatches == 16
    assert plan.peak.states.gradients / 2**30 == pytest.approx(14.96, abs=0.01)
    assert plan.fits
    assert not make_plan(cfg, lay, Workload(8192, 2, 512), Cluster(gpus=64), precision="bf16").fits
