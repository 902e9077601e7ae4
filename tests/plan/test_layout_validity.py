"""One set of layout rules for the trainer and the planner: every layout the search proposes for the
tiny configs on 4 and 8 ranks passes the trainer's start-up validation (config overrides as
`tessera train --set parallel.K=V` applies them, ParallelDims.validate, check_batch_layout), and
over every combination of sizes the planner refuses exactly what the trainer refuses."""

from __future__ import annotations

import dataclasses
from itertools import product

import pytest

from tessera.config.errors import TesseraError
from tessera.config.layout_rules import LayoutSizes, layout_problems, pipeline_microbatch_problem
from tessera.config.parallel import ParallelConfig
from tessera.config.presets import get_preset
from tessera.config.schema import load_config
from tessera.parallel.dims import ParallelDims
from tessera.parallel.pipeline import schedule_accepts_microbatches
from tessera.plan.cluster import Cluster
from tessera.plan.layout import Layout, Workload
from tessera.plan.layout import layout_problems as plan_problems
from tessera.plan.run_inputs import load_run_inputs
from tessera.plan.search import divisors, search
from tessera.train.run.layout import check_batch_layout

TINY_CONFIGS = ("configs/tiny-dense.yaml", "configs/tiny-moe.yaml")


def trainer_refusal(path: str, overrides: list[str], world: int) -> str | None:
    """What `tessera train --nproc world --set ...` refuses before building anything (None: accepted)."""
    try:
        cfg = load_config(path, overrides)
        dims = ParallelDims.from_config(cfg.parallel, world)
        dims.validate(cfg.model, world, seq_len=cfg.train.seq_len, vpp=cfg.parallel.vpp)
        check_batch_layout(cfg, dims)
    except TesseraError as e:
        return str(e)
    return None


def as_overrides(parallel: dict) -> list[str]:
    return [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in parallel.items()]


@pytest.mark.parametrize("path", TINY_CONFIGS)
@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_every_layout_the_search_proposes_is_accepted_by_the_trainer(path, world):
    inputs = load_run_inputs(path)
    result = search(inputs.model, inputs.work, Cluster.for_gpu("h100", gpus=world))
    proposed = result.ranked + result.too_big
    assert len(proposed) > 20
    assert {p.layout.pp for p in proposed} > {1} and {p.layout.tp for p in proposed} > {1}
    if inputs.model.is_moe:
        assert {p.layout.ep for p in proposed} > {1}
    for plan in proposed:
        overrides = as_overrides(plan.layout.parallel_settings())
        assert trainer_refusal(path, overrides, world) is None, (plan.layout.describe(), overrides)


def _sizes(world: int):
    d = divisors(world)
    for tp, pp, cp, rep, shard, ep in product(d, d, d, d, d, d):
        if tp * pp * cp * rep * shard == world:
            yield tp, pp, cp, rep, shard, ep


@pytest.mark.parametrize("preset,changes", [
    ("tiny-llama", {}), ("tiny-llama", {"tie_embeddings": True}), ("tiny-moe", {}),
    ("tiny-deepseek", {}), ("tiny-deepseek", {"moe": {"seq_aux_loss_coef": 1e-4, "n_groups": 4,
                                                      "topk_groups": 2}}),
])
def test_planner_and_trainer_refuse_the_same_layouts(preset, changes):
    """Brute force over every size on 8 ranks, with and without sp: the planner's rules are the trainer's."""
    base = get_preset(preset)
    if "moe" in changes:
        cfg = dataclasses.replace(base, moe=dataclasses.replace(base.moe, **changes["moe"]))
    else:
        cfg = get_preset(preset, **changes)
    seq_len = 16
    refused = accepted = 0
    for tp, pp, cp, rep, shard, ep in _sizes(8):
        for sp in ((False, True) if tp > 1 else (False,)):
            sizes = LayoutSizes(tp=tp, sp=sp, pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, ep=ep)
            rules = layout_problems(cfg, sizes, world_size=8, seq_len=seq_len)
            try:
                par = ParallelConfig(tp=tp, sp=sp, pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, ep=ep)
                ParallelDims.from_config(par, 8).validate(cfg, 8, seq_len=seq_len)
                trainer = None
            except TesseraError as e:
                trainer = str(e)
            assert (trainer is None) == (not rules), (sizes, trainer, rules)
            if trainer is not None:
                assert trainer == rules[0]
                refused += 1
            else:
                accepted += 1
            lay = Layout(tp=tp, sp=sp, pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, ep=ep)
            planned = plan_problems(cfg, lay, Workload(seq_len, 1, 64))
            assert bool(planned) == bool(rules), (sizes, planned, rules)
    assert refused and accepted


def test_tied_embeddings_and_mla_are_accepted_and_sequence_losses_refused_under_cp():
    tied = get_preset("tiny-llama", tie_embeddings=True)
    assert not layout_problems(tied, LayoutSizes(tp=2))
    assert not layout_problems(tied, LayoutSizes(pp=2))
    assert not layout_problems(tied, LayoutSizes(dp_shard=2, cp=2), seq_len=16)
    mla = get_preset("tiny-deepseek")
    assert not layout_problems(mla, LayoutSizes(tp=2))
    assert not layout_problems(mla, LayoutSizes(cp=2, dp_shard=2), seq_len=16)
    seq_loss = get_preset("tiny-deepseek")
    seq_loss.moe.seq_aux_loss_coef = 1e-4
    assert not layout_problems(seq_loss, LayoutSizes(cp=2, dp_shard=2), seq_len=16)  # per-sequence counts over cp
    assert any("must be a multiple of cp=4" in p for p in layout_problems(mla, LayoutSizes(cp=4, ep=2, dp_shard=2)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_pipeline_microbatch_rule_is_the_schedules(schedule):
    for pp in (2, 3, 4):
        for m in range(1, 5 * pp):
            accepted = pipeline_microbatch_problem(schedule, m, pp) is None
            assert accepted == schedule_accepts_microbatches(schedule, m, pp), (schedule, m, pp)
