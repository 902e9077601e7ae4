"""Layout search: every valid layout and only those, fits before speed, and reasons for the winners."""

from __future__ import annotations

import sys
from itertools import product

import pytest

from tessera.config import get_preset
from tessera.plan.cluster import Cluster
from tessera.plan.estimate import make_plan
from tessera.plan.layout import Layout, Workload, layout_problems
from tessera.plan.search import MAX_SEARCH_LAYOUTS, divisors, enumerate_layouts, search, time_components


def test_enumeration_is_exactly_the_valid_layouts():
    """Brute force over every size of every dimension (8 GPUs) against the enumeration."""
    cfg = get_preset("tiny-moe", n_layers=4)
    work = Workload(seq_len=64, micro_batch=1, global_batch=16)
    world = 8
    got = {lay for lay in enumerate_layouts(cfg, work, world, gpus_per_node=8)}
    want = set()
    sizes = divisors(world)
    for tp, pp, cp, rep, shard, ep in product(sizes, sizes, sizes, sizes, sizes, sizes):
        if tp * pp * cp * rep * shard != world:
            continue
        schedules = [("1f1b", 1)] + ([("zero_bubble", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)]
                                     if pp > 1 else [])
        for zero, rc, (sched, v) in product((1, 2, 3), ("none", "selective", "op", "full"), schedules):
            if shard * cp == 1 and zero != 1:
                continue
            lay = Layout(tp=tp, sp=tp > 1, pp=pp, vpp=v, pp_schedule=sched, dp_replicate=rep, dp_shard=shard,
                         cp=cp, ep=ep, zero_stage=zero, recompute=rc)
            if not layout_problems(cfg, lay, work, even_layers=True):
                want.add(lay)
    assert got == want
    assert all(lay.world == world for lay in got)
    assert any(lay.ep == 8 for lay in got) and any(lay.pp == 4 for lay in got) and any(lay.cp == 2 for lay in got)


def test_search_ranks_fitting_layouts_by_time_in_seconds():
    cfg = get_preset("llama3-8b")
    cluster = Cluster(gpus=64)
    result = search(cfg, Workload(8192, 1, 512), cluster)
    assert 1000 < result.valid <= MAX_SEARCH_LAYOUTS and result.ranked  # bounded by candidates, not by time
    times = [p.time.total for p in result.ranked]
    assert all(a <= b + 1e-6 for a, b in zip(times, times[1:]))  # ties broken by memory
    assert all(p.fits for p in result.ranked)
    best = result.ranked[0]
    assert best.peak.total <= cluster.usable_memory
    worst_fitting = result.ranked[-1].time.total
    assert best.time.total < worst_fitting
    reasons = result.reasons(3)
    assert len(reasons) == 3 and all("s/step" in r and "beats the next" in r for r in reasons)
    parts = time_components(best)
    assert sum(parts.values()) == pytest.approx(best.time.total, rel=1e-9)


def test_search_reports_the_smallest_layouts_when_nothing_fits():
    """DeepSeek-V3 (671B) needs ~12 TB of model states: more than 64 x 80 GB."""
    cfg = get_preset("deepseek-v3")
    result = search(cfg, Workload(4096, 1, 64), Cluster(gpus=64))
    assert not result.ranked
    assert result.too_big and all(p.peak.total > p.cluster.usable_memory for p in result.too_big)
    assert result.too_big[0].peak.total <= result.too_big[-1].peak.total


def test_search_needs_sharding_or_model_parallelism_for_a_70b_model():
    cfg = get_preset("llama3-70b")
    result = search(cfg, Workload(4096, 1, 256), Cluster(gpus=64))
    assert result.ranked
    best = result.ranked[0].layout
    # 70B x 18 bytes = 1.26 TB of model states: a rank must hold at most 1/16 of them.
    assert best.tp * best.pp * (best.dp_shard * best.cp if best.zero_stage >= 1 else 1) >= 16


def test_a_space_beyond_the_bound_is_sampled_and_says_so():
    """The candidates are counted before any is planned; over `max_layouts` a uniform sample of that
    many (fixed seed) is planned, the same on every call, and the result says it is a sample."""
    from tessera.plan.search import candidate_layouts

    cfg = get_preset("tiny-moe", n_layers=4)
    work = Workload(seq_len=64, micro_batch=1, global_batch=16)
    cluster = Cluster.for_gpu("h100", gpus=8)
    whole = search(cfg, work, cluster)
    assert not whole.sampled and whole.candidates > 40 and "all" in whole.coverage()
    every = set(enumerate_layouts(cfg, work, 8, gpus_per_node=8))
    assert whole.valid == len(every)
    bounded = search(cfg, work, cluster, max_layouts=40)
    assert bounded.sampled and bounded.candidates == whole.candidates and bounded.valid <= 40
    assert "uniform sample of 40" in bounded.coverage() and "may be missing" in bounded.coverage()
    first = list(candidate_layouts(cfg, work, 8, 8, max_layouts=40).layouts)
    assert first == list(candidate_layouts(cfg, work, 8, 8, max_layouts=40).layouts)  # the fixed seed
    assert set(first) <= every and len(set(first)) == len(first) == bounded.valid


def test_a_large_search_plans_at_most_the_bound(monkeypatch):
    """DeepSeek-V3 on 2^20 GPUs: a space of tens of thousands of candidate layouts, more than the
    default bound too, of which the search plans (calls the planner on) no more than `max_layouts`,
    counted at the planner's entry point."""
    planned = []

    def counted_make_plan(*args, **kwargs):
        planned.append(args[1])
        return make_plan(*args, **kwargs)

    # the module itself: `tessera.plan.search` as an attribute is the function the package exports
    monkeypatch.setattr(sys.modules["tessera.plan.search"], "make_plan", counted_make_plan)
    result = search(get_preset("deepseek-v3"), Workload(4096, 1, 2**20), Cluster.for_gpu("h100", gpus=2**20),
                    max_layouts=200)
    assert result.candidates > MAX_SEARCH_LAYOUTS and result.sampled
    assert 0 < len(planned) == result.valid <= 200
    assert "uniform sample of 200" in result.coverage()
