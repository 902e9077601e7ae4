"""The forked-rank harness: results by rank, a rank's exception named with its rank, hangs
turned into failures by the process-group timeout or the parent's deadline."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.forked_ranks import RankFailure, run_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": t.item(), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS")}


def _rank1_raises():
    if dist.get_rank() == 1:
        raise KeyError("no such expert")
    dist.barrier()


def _rank1_skips_collective():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins: gloo's timeout must end this
    else:
        time.sleep(30)  # alive, so the connection stays open


def _sleeps():
    time.sleep(60)


@pytest.mark.dist
def test_results_come_back_in_rank_order():
    results = run_ranks(_sum_of_ranks, 3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"] == 3.0 and r["threads"] == 1 and r["omp"] == "1" for r in results)


@pytest.mark.dist
def test_exception_names_the_rank():
    with pytest.raises(RankFailure, match="rank 1 of 2 failed") as info:
        run_ranks(_rank1_raises, 2)
    assert info.value.rank == 1 and "KeyError: 'no such expert'" in str(info.value)


@pytest.mark.dist
def test_hang_in_collective_fails_by_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0 of 2 failed") as info:
        run_ranks(_rank1_skips_collective, 2, timeout=1.0)
    assert time.monotonic() - start < 10
    assert "timeout" in str(info.value).lower() or "timed out" in str(info.value).lower()


@pytest.mark.dist
def test_parent_deadline_kills_stuck_ranks():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"did not finish within 3.0 s"):
        run_ranks(_sleeps, 2, timeout=1.0)
    assert time.monotonic() - start < 8
