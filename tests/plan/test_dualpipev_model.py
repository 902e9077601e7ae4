"""The planner's model of the trainer's DualPipeV (tessera/parallel/pipeline_overlap.py): read from torch's
own schedule (ScheduleDualPipeV's actions, no process group), its ranks hold at most p + 1 micro-batches'
worth of their layers (DeepSeek-V3's table 2, what the planner multiplies by), the last stage holds one
micro-batch (so the head's saved logits count once, not p + 1 times), and the trainer overlaps the pairs
exactly where the planner assumes the expert all-to-all hidden."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.parallel.dims import ParallelDims
from tessera.parallel.pipeline_overlap import overlaps
from tessera.plan.activations import head_in_flight, in_flight_microbatches, stage_activations
from tessera.plan.layout import Layout, Workload, pairs_overlap

FORWARD, DONE = _ComputationType.FORWARD, (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT)


def torch_dualpipev_peaks(p: int, m: int, rank: int) -> tuple[dict[int, int], float]:
    """Micro-batches each of `rank`'s two stages holds at its peak (forwarded, weight gradient not yet
    taken), and the peak of both together in units of the rank's layers (each stage holds half of
    them); a pair's forward counts before its backward frees (they run at once)."""
    acts = ScheduleDualPipeV._calculate_single_rank_operations(SimpleNamespace(pp_group_size=p, _n_microbatches=m),
                                                                rank)
    held: dict[int, set[int]] = {}
    peak: dict[int, int] = {}
    together = 0.0
    for action in filter(None, acts):
        subs = action.sub_actions or (action,)
        for a in subs:
            if a.computation_type == FORWARD:
                held.setdefault(a.stage_index, set()).add(a.microbatch_index)
        for stage, mbs in held.items():
            peak[stage] = max(peak.get(stage, 0), len(mbs))
        together = max(together, sum(len(mbs) for mbs in held.values()) / 2)
        for a in subs:
            if a.computation_type in DONE:
                held[a.stage_index].discard(a.microbatch_index)
    return peak, together


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 24), (16, 120)])
def test_dualpipev_in_flight_is_within_deepseeks_p_plus_one_and_its_head_holds_one(p, m):
    for rank in range(p):
        peak, together = torch_dualpipev_peaks(p, m, rank)
        assert together <= in_flight_microbatches("dualpipe", p, m, rank=rank) == min(p + 1, m)
        if rank == 0:  # holds the last stage (2 p - 1) and so the head
            assert peak[2 * p - 1] == head_in_flight("dualpipe", p, m, rank=rank) == 1
    assert head_in_flight("1f1b", 4, 8, rank=3) == in_flight_microbatches("1f1b", 4, 8, rank=3)


def test_the_head_counts_once_in_dualpipes_stored_activations():
    cfg = get_preset("tiny-moe", n_layers=4)
    work = Workload(seq_len=64, micro_batch=1, global_batch=16)
    lay = Layout(pp=2, pp_schedule="dualpipe", dp_shard=1)
    last = stage_activations(cfg, lay, work, "bf16")[-1]
    assert last.head > 0 and last.in_flight == 3
    first = stage_activations(cfg, lay, work, "bf16")[0]
    model_level = first.stored / first.in_flight - first.per_microbatch
    assert last.stored == pytest.approx(last.in_flight * (last.per_microbatch + model_level) + last.head)


@pytest.mark.parametrize("parallel,overlapped", [
    ({"pp": 2, "pp_schedule": "dualpipev", "ep": 2, "dp_shard": 2}, True),
    ({"pp": 2, "pp_schedule": "dualpipev", "ep": 2, "dp_shard": 2, "pp_overlap": False}, False),
    ({"pp": 2, "pp_schedule": "dualpipev", "tp": 2, "dp_shard": 1}, False),
    ({"pp": 2, "pp_schedule": "dualpipev", "cp": 2, "dp_shard": 1}, False),
    ({"pp": 2, "pp_schedule": "1f1b", "ep": 2, "dp_shard": 2}, False),
])
def test_planner_assumes_the_all_to_all_hidden_where_the_trainer_overlaps_the_pairs(parallel, overlapped):
    par = ParallelConfig(**parallel)
    dims = ParallelDims.from_config(par, 4)
    assert pairs_overlap(par) == (par.pp_schedule == "dualpipev" and par.pp_overlap and overlaps(dims)) == overlapped
    assert Layout.from_parallel(par, 4).ep_overlap == overlapped
