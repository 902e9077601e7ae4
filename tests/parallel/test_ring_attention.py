"""The zig-zag split and the ring / all-gather attention cores against one device's causal SDPA over
the whole sequence: each rank holds its zig-zag tokens (chunks r and 2 cp - 1 - r) of q, k, v and
must get, token by token, the single-device output and gradients of q, k and v (GQA, sliding
window, MLA-like head dims). The ring's transfers are issued before each block's compute."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.config.errors import ParallelError
from tessera.models.attention import causal_attention
from tessera.parallel.context_parallel import ChunkPositions, ContextParallelAttention
from tessera.parallel.sequence_layout import all_rank_positions, rank_positions, take_rank_tokens, to_sequence_order
from tests.forked_ranks import run_ranks
from tests.parallel.test_context_parallel_attention import case_tensors

B, S = 2, 16
# name: (query heads, kv heads, qk head dim, v head dim, sliding window, method)
CASES = {
    "ring-gqa": (4, 2, 8, 8, None, "ring"),
    "ring-mla-head-dims": (4, 4, 12, 6, None, "ring"),
    "ring-window": (3, 1, 8, 8, 5, "ring"),
    "allgather-zigzag-gqa": (4, 2, 8, 8, None, "allgather"),
    "allgather-zigzag-window": (4, 2, 8, 8, 3, "allgather"),
}


def _tensors(name: str):
    return case_tensors(name, CASES)


def _on_rank() -> dict:
    rank, cp = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (_, _, D, _, window, method) in CASES.items():
        core = ContextParallelAttention(dist.group.WORLD, method, "zigzag")
        events: list = []
        core.ring.trace = lambda *e, log=events: log.append(e)
        q, k, v, g = (take_rank_tokens(t, cp, rank, "zigzag", dim=2).clone().requires_grad_(i < 3)
                      for i, t in enumerate(_tensors(name)))
        y = core(q, k, v, D**-0.5, window)
        (y * g).sum().backward()
        out[name] = (y.detach(), q.grad, k.grad, v.grad, events)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_cores_equal_full_causal_attention_forward_and_backward(cp):
    results = run_ranks(_on_rank, cp)
    for name, (_, _, D, _, window, _method) in CASES.items():
        q, k, v, g = _tensors(name)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        y = causal_attention(q, k, v, D**-0.5, window)
        (y * g).sum().backward()
        for i, ref in enumerate((y.detach(), q.grad, k.grad, v.grad)):
            got = to_sequence_order(torch.stack([r[name][i] for r in results]).transpose(2, 3),
                                    "zigzag")  # [cp, B, C, H, D] -> [B, S, H, D]
            torch.testing.assert_close(got.transpose(1, 2), ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, j=i: f"{n}[{j}]: {m}")


@pytest.mark.dist
def test_ring_issues_each_transfer_before_computing_the_block():
    """Overlap: in both passes, the send/receive of the next block (step i) is issued before the
    compute of step i, for every step that has a next block; every block is computed once."""
    results = run_ranks(_on_rank, 4)
    for r in results:
        events = r["ring-gqa"][4]
        for phase in ("forward", "backward"):
            sends = [i for i, e in enumerate(events) if e[:2] == ("send", phase)]
            computes = {e[2]: i for i, e in enumerate(events) if e[:2] == ("compute", phase)}
            assert len(sends) == 3 and sorted(computes) == [0, 1, 2, 3]  # zig-zag: every block pair has work
            for step, position in enumerate(sends):
                assert events[position][2] == step and position < computes[step]


def _ring_work(layout: str) -> int:
    """(query, key) pairs this rank's ring core computes in the forward of one causal attention."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    core = ContextParallelAttention(dist.group.WORLD, "ring", layout)
    pairs: list = []
    core.ring.trace = lambda event, phase, step, n: pairs.append(n)
    q, k, v, _ = (take_rank_tokens(t, cp, rank, layout, dim=2) for t in _tensors("ring-gqa"))
    core(q, k, v, 8**-0.5)
    return sum(pairs)


@pytest.mark.dist
def test_zigzag_ring_gives_every_rank_the_same_causal_work():
    """S = 16 over 4 ranks: zig-zag, every rank computes 40 (query, key) pairs (the diagonal block
    with its causal halves, then half of each other block); the contiguous split would give the last
    rank 4 blocks of 16 pairs and the first one only its diagonal block."""
    assert run_ranks(_ring_work, 4, "zigzag") == [40] * 4
    assert run_ranks(_ring_work, 4, "contiguous") == [16, 32, 48, 64]


def test_zigzag_positions_and_order():
    assert all_rank_positions(4, 2, "zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert rank_positions(4, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    x = torch.arange(16).view(2, 8)
    parts = torch.stack([take_rank_tokens(x, 2, r, "zigzag") for r in range(2)])  # [P, B, C]
    assert parts[0, 0].tolist() == [0, 1, 6, 7]
    assert torch.equal(to_sequence_order(parts.unsqueeze(-1), "zigzag").squeeze(-1), x)
    assert ChunkPositions(1, 2, "zigzag")(1, 4, torch.device("cpu")).tolist() == [[2, 3, 4, 5]]
    with pytest.raises(ParallelError, match="cuts every sequence into 4 chunks"):
        take_rank_tokens(torch.zeros(1, 6), 2, 0, "zigzag")
