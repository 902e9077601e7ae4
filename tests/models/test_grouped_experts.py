"""The grouped GEMM equals a per-expert loop, forward and backward, empty experts included."""

import pytest
import torch

from tessera.models.moe import GroupedExperts, grouped_linear
from tessera.models.moe.experts import grouped_mm_applies


def _loop(x, experts, counts):
    outs = []
    for e, c in enumerate(torch.split(x, counts.tolist())):
        h = torch.nn.functional.silu(c @ experts.w1[e].T) * (c @ experts.w3[e].T)
        outs.append(h @ experts.w2[e].T)
    return torch.cat(outs)


@pytest.mark.parametrize("dim,hidden", [(16, 8), (6, 5)])  # aligned (grouped_mm) and unaligned (loop path)
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_grouped_experts_match_loop_with_empty_experts(dim, hidden, use_grouped_mm):
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(5, dim, hidden, use_grouped_mm=use_grouped_mm)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    counts = torch.tensor([3, 0, 4, 0, 2])  # experts 1 and 3 get no tokens
    x = torch.randn(int(counts.sum()), dim, generator=gen, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = [p.detach().clone().requires_grad_(True) for p in (experts.w1, experts.w2, experts.w3)]
    twin = GroupedExperts(5, dim, hidden)
    twin.w1, twin.w2, twin.w3 = (torch.nn.Parameter(r) for r in ref)

    y = experts(x, counts)
    y_ref = _loop(x_ref, twin, counts)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    y.sum().backward()  # expanded (stride-0) upstream gradient on purpose
    y_ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for p, r in zip((experts.w1, experts.w2, experts.w3), (twin.w1, twin.w2, twin.w3)):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-5, rtol=1e-5)
    for e in (1, 3):
        assert experts.w1.grad[e].abs().sum() == 0


def test_grouped_mm_used_where_it_applies():
    assert grouped_mm_applies(torch.zeros(3, 16), torch.zeros(2, 8, 16))
    assert not grouped_mm_applies(torch.zeros(3, 6), torch.zeros(2, 8, 6))
    bf16 = dict(dtype=torch.bfloat16)
    assert not grouped_mm_applies(torch.zeros(3, 16, **bf16), torch.zeros(2, 12, 16, **bf16))


def test_grouped_linear_bf16():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen).bfloat16()
    w = torch.randn(3, 16, 16, generator=gen).bfloat16()
    counts = torch.tensor([2, 0, 4])
    got = grouped_linear(x, w, counts)
    want = torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T])
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
