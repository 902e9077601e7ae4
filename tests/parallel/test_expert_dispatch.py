"""Expert-parallel dispatchers against the single-process `LocalDispatcher`: outputs, input and
gate gradients, and expert-weight gradients (which sum the tokens of every rank), including
experts and whole ranks that receive no tokens, and padded capacity."""

import pytest
import torch
import torch.distributed as dist

from tessera.models.moe import GroupedExperts, LocalDispatcher
from tessera.parallel.expert_dispatch import AllGatherDispatcher, AllToAllDispatcher
from tests.forked_ranks import run_ranks

E, D, F, T, K = 4, 16, 8, 6, 2


def _inputs(rank: int, routing: str):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, D, generator=g)
    weights = torch.rand(T, K, generator=g)
    if routing == "first-rank-only":  # experts 2 and 3 (all of rank 1's) get nothing
        indices = torch.stack([torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long)], dim=1)
    else:
        indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    probe = torch.randn(T, D, generator=g)
    return x, indices, weights, probe


def _experts() -> GroupedExperts:
    experts = GroupedExperts(E, D, F)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    return experts


def _run(dispatcher, experts, x, indices, weights, probe, keep=None, capacity=None):
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    rows, tokens_per_expert, ctx = dispatcher.dispatch(x, indices, keep, capacity)
    out = dispatcher.combine(experts(rows, tokens_per_expert), weights, ctx)
    (out * probe).sum().backward()
    return out.detach(), x.grad, weights.grad


def _keep(indices, capacity):
    # First-come slots up to `capacity` per expert (the exact mask does not matter here).
    rank_TE = torch.zeros(T, E, dtype=torch.long).scatter_(1, indices, 1).cumsum(0)
    return rank_TE.gather(1, indices) <= capacity


def _on_rank(kind: str, routing: str, pad: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    capacity = 3 if pad else None
    per_rank = E // world
    full = _experts()
    local = GroupedExperts(per_rank, D, F)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(local, name).copy_(getattr(full, name)[rank * per_rank:(rank + 1) * per_rank])
    if kind == "alltoall":
        dispatcher = AllToAllDispatcher(E, dist.group.WORLD, pad_to_capacity=pad)
    else:
        dispatcher = AllGatherDispatcher(E, dist.group.WORLD)
    x, indices, weights, probe = _inputs(rank, routing)
    keep = _keep(indices, capacity) if pad else None
    out, gx, gw = _run(dispatcher, local, x, indices, weights, probe, keep, capacity)
    # Reference: every rank's tokens through the full experts on one process.
    ref = {}
    for r in range(world):
        xr, ir, wr, pr = _inputs(r, routing)
        kr = _keep(ir, capacity) if pad else None
        ref[r] = _run(LocalDispatcher(E, pad), full, xr, ir, wr, pr, kr, capacity)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return {"out": (out, ref[rank][0]), "x_grad": (gx, ref[rank][1]), "gate_grad": (gw, ref[rank][2]),
            **{f"{n}_grad": (getattr(local, n).grad, getattr(full, n).grad[mine])
               for n in ("w1", "w2", "w3")}}


@pytest.mark.dist
@pytest.mark.parametrize("kind,routing,pad", [
    ("alltoall", "random", False),
    ("alltoall", "first-rank-only", False),
    ("alltoall", "random", True),
    ("allgather", "random", False),
    ("allgather", "first-rank-only", False),
])
def test_dispatcher_matches_local(kind, routing, pad):
    for rank_result in run_ranks(_on_rank, 2, kind, routing, pad):
        for name, (got, want) in rank_result.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.dist
def test_expert_without_tokens_gets_zero_gradient():
    results = run_ranks(_on_rank, 2, "alltoall", "first-rank-only", False)
    w1_grad_rank1 = results[1]["w1_grad"][0]
    assert w1_grad_rank1 is not None and torch.count_nonzero(w1_grad_rank1) == 0
    assert torch.count_nonzero(results[0]["w1_grad"][0]) > 0
