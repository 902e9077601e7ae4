"""Context-parallel attention cores against one device's causal SDPA over the whole sequence.

Each rank holds a contiguous chunk of q, k, v; the all-to-all (Ulysses) and all-gather cores must
give, chunk by chunk, the single-device output and the gradients of q, k and v (GQA, kv heads
fewer than cp, sliding window, MLA-like head dims where v's differs from q's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.config.errors import ParallelError
from tessera.models.attention import causal_attention
from tessera.parallel.context_parallel import ContextParallelAttention, kv_repeats
from tests.forked_ranks import run_ranks

B, S = 2, 16
# name: (query heads, kv heads, qk head dim, v head dim, sliding window, method; None = automatic)
CASES = {
    "gqa-alltoall": (4, 2, 8, 8, None, None),
    "kv-heads-fewer-than-cp": (4, 1, 8, 8, None, "alltoall"),
    "mla-head-dims": (4, 4, 12, 6, None, None),
    "window-alltoall": (4, 2, 8, 8, 5, None),
    "gqa-allgather": (4, 2, 8, 8, None, "allgather"),
    "heads-not-divisible-allgather-window": (3, 1, 8, 8, 5, None),
}


def case_tensors(name: str, cases: dict) -> tuple[torch.Tensor, ...]:
    """q, k, v and an upstream gradient of attention case `name` of `cases` (H, G, D, Dv, ...),
    seeded by the name: the same tensors on every rank."""
    H, G, D, Dv = cases[name][:4]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q, k = torch.randn(B, H, S, D, generator=gen), torch.randn(B, G, S, D, generator=gen)
    v, g = torch.randn(B, G, S, Dv, generator=gen), torch.randn(B, H, S, Dv, generator=gen)
    return q, k, v, g


def _tensors(name: str):
    return case_tensors(name, CASES)


def _on_rank() -> dict:
    rank, cp = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (_, _, D, _, window, method) in CASES.items():
        core = ContextParallelAttention(dist.group.WORLD, method)
        chunks = [t.chunk(cp, dim=2)[rank].clone().requires_grad_(i < 3) for i, t in enumerate(_tensors(name))]
        q, k, v, g = chunks
        y = core(q, k, v, D**-0.5, window)
        (y * g).sum().backward()
        out[name] = (core.method_for(q.shape[1]), y.detach(), q.grad, k.grad, v.grad)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("cp", [2, 4])
def test_cores_equal_full_causal_attention_forward_and_backward(cp):
    results = run_ranks(_on_rank, cp)
    for name, (H, _, D, _, window, method) in CASES.items():
        if H % cp and method == "alltoall":
            continue
        q, k, v, g = _tensors(name)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        y = causal_attention(q, k, v, D**-0.5, window)
        (y * g).sum().backward()
        want_method = method or ("alltoall" if H % cp == 0 else "allgather")
        assert all(r[name][0] == want_method for r in results), name
        for i, ref in enumerate((y.detach(), q.grad, k.grad, v.grad), start=1):
            got = torch.cat([r[name][i] for r in results], dim=2)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, j=i: f"{n}[{j}]: {m}")


def test_kv_heads_repeat_to_what_cp_divides():
    assert kv_repeats(4, 2, 2) == 1  # each rank takes one kv head
    assert kv_repeats(4, 1, 2) == 2 and kv_repeats(4, 1, 4) == 4
    assert kv_repeats(8, 2, 4) == 2
    with pytest.raises(ParallelError, match="cp=4 does not divide the 6 local query heads"):
        kv_repeats(6, 2, 4)
