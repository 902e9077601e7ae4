"""The planner's data-parallel collectives equal what the trainer's FSDP2 does, call for call and
byte for byte, under gradient accumulation: weights gathered for every micro-batch (twice for the
blocks under ZeRO-3), gradients reduce-scattered once per step. The trainer's side is
`log.comm_stats` (tessera.parallel.comm_stats, summed over ranks); the planner's is
`stage_collectives` for the same model, layout and batch."""

from __future__ import annotations

import pytest

from tessera.config.schema import load_config
from tessera.plan.comm import stage_collectives
from tessera.plan.estimate import precisions_for_train_dtype
from tessera.plan.layout import Layout, Workload
from tessera.plan.memory import get_precision, rank_params
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import MODELS, overrides_for, train_on_ranks
from tests.train.runs import build_small_dataset

KINDS = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter"}
STEPS = 2


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> str:
    return build_small_dataset(tmp_path_factory.mktemp("data"))


def _planned(model: str, overrides: list[str], world: int) -> dict[str, tuple[float, float]]:
    """(calls, payload bytes) per rank and step of the planner's all-gathers and reduce-scatters."""
    cfg = load_config(MODELS[model][0], overrides)
    t = cfg.train
    lay = Layout.from_parallel(cfg.parallel, world)
    work = Workload(t.seq_len, t.micro_batch_size, t.global_batch_size)
    precision, act_dtype = precisions_for_train_dtype(t.dtype)
    colls = stage_collectives(cfg.model, lay, work, 0, rank_params(cfg.model, lay)[0], get_precision(precision),
                              act_dtype)
    m = lay.microbatches(work)
    assert m == 2  # the point: several micro-batches per step
    out = dict.fromkeys(KINDS.values(), (0.0, 0.0))
    for c in colls:
        assert c.group in ("dp_shard", "ep_dp"), c  # nothing else in these layouts
        calls = c.calls_per_microbatch * m + c.calls_per_step
        done_calls, done_bytes = out[KINDS[c.op]]
        out[KINDS[c.op]] = (done_calls + calls, done_bytes + calls * c.size)
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("model, layout", [
    ("dense", {"parallel.dp_shard": 2, "parallel.zero_stage": 3}),
    ("moe", {"parallel.dp_shard": 2, "parallel.zero_stage": 2}),
], ids=["dense-fsdp2-zero3", "moe-fsdp2-zero2"])
def test_planner_counts_the_trainers_collectives_under_accumulation(model, layout, small_dataset, tmp_path):
    world = 2
    # Global batch 4 over 2 data-parallel ranks in micro-batches of 1: 2 micro-batches per rank.
    overrides = overrides_for(model, small_dataset, tmp_path, STEPS, **layout,
                              **{"train.micro_batch_size": 1, "log.comm_stats": True})
    planned = _planned(model, overrides, world)
    records = run_ranks(train_on_ranks, world, model, overrides)[0]["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for rec in records:
        for kind, (calls, nbytes) in planned.items():
            assert calls > 0
            assert rec[f"comm/{kind}_calls"] == world * calls, (kind, rec[f"comm/{kind}_calls"], world * calls)
            assert rec[f"comm/{kind}_bytes"] == world * nbytes, (kind, rec[f"comm/{kind}_bytes"], world * nbytes)
