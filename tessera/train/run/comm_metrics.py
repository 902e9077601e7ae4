"""The communication figures of one step, as metric fields: what `CollectiveCounter` counted on
each rank, summed over ranks.

    comm/<kind>_calls, comm/<kind>_bytes   over all ranks, for each kind that ran (comm_stats.KINDS)
    comm/total_bytes                       all kinds, all ranks
    comm/max_rank_bytes                    the busiest rank's payload bytes (imbalance: pipeline
                                           stages, the rank that ends a vocabulary-parallel loss)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.parallel.comm_stats import KINDS, CollectiveCounter
from tessera.train.run.layout import RunLayout


def comm_record(counter: CollectiveCounter, layout: RunLayout) -> dict[str, int]:
    """Metric fields of the step `counter` watched (a collective over all ranks when distributed)."""
    vec = torch.tensor(counter.as_vector(), dtype=torch.int64)
    rank_total = torch.tensor([int(vec[len(KINDS):].sum())], dtype=torch.int64)
    if layout.distributed:
        dist.all_reduce(vec)
        dist.all_reduce(rank_total, op=dist.ReduceOp.MAX)
    calls, nbytes = vec[:len(KINDS)].tolist(), vec[len(KINDS):].tolist()
    out: dict[str, int] = {}
    for kind, c, b in zip(KINDS, calls, nbytes):
        if c:
            out[f"comm/{kind}_calls"] = c
            out[f"comm/{kind}_bytes"] = b
    out["comm/total_bytes"] = sum(nbytes)
    out["comm/max_rank_bytes"] = int(rank_total.item())
    return out
