"""Rows a capacity drops stay in place after the last expert's, and `torch._grouped_mm` never
writes them: neither their output nor their input's gradient. Whatever memory they hold (NaN
here, to make it certain) must reach no output and no gradient.

The grouped GEMM is wrapped so that those rows are NaN on both passes, as uninitialised memory
may be; the layer's output and every gradient must then equal, bit for bit, those of the plain
run, and be finite.
"""

from __future__ import annotations

import pytest
import torch

from tessera.config.model import MoEConfig
from tessera.models.moe.layer import MoE

GROUPED_MM = getattr(torch, "_grouped_mm", None)


class _NaNGradientAfterLastGroup(torch.autograd.Function):
    """Identity whose backward makes the gradient of rows past the last group NaN."""

    @staticmethod
    def forward(ctx, x, grouped_N1):
        ctx.save_for_backward(grouped_N1)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (grouped_N1,) = ctx.saved_tensors
        return torch.where(grouped_N1, g, float("nan")), None


UNWRITTEN_ROWS: list[int] = []  # per call: rows past the last group


def _grouped_mm_with_nan_after_last_group(x, w, offs=None, **kwargs):
    grouped_N1 = (torch.arange(x.shape[0], device=x.device) < offs[-1])[:, None]
    UNWRITTEN_ROWS.append(int((~grouped_N1).sum()))
    y = GROUPED_MM(_NaNGradientAfterLastGroup.apply(x, grouped_N1), w, offs=offs, **kwargs)
    return torch.where(grouped_N1, y, float("nan"))


def _step(changes: dict, nan_rows: bool, monkeypatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    cfg = MoEConfig(**{"num_experts": 4, "top_k": 2, "ffn_dim": 32, "aux_loss_coef": 0.01, **changes})
    layer = MoE(64, cfg).train()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with monkeypatch.context() as patch:
        if nan_rows:
            patch.setattr(torch, "_grouped_mm", _grouped_mm_with_nan_after_last_group)
        y, route = layer(x)
        (y.square().sum() + sum(route.losses.values())).backward()
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.skipif(GROUPED_MM is None, reason="torch has no _grouped_mm")
@pytest.mark.parametrize("changes", [
    {"capacity_factor": 0.5, "drop_policy": "probs"},
    {"capacity_factor": 1.0, "drop_policy": "position", "shared_ffn_dim": 32, "seq_aux_loss_coef": 0.01,
     "z_loss_coef": 0.001},
], ids=["probs", "position-every-loss"])
def test_rows_the_grouped_gemm_leaves_unwritten_reach_no_output_and_no_gradient(changes, monkeypatch):
    want_y, want = _step(changes, False, monkeypatch)
    UNWRITTEN_ROWS.clear()
    got_y, got = _step(changes, True, monkeypatch)
    assert len(UNWRITTEN_ROWS) == 3 and min(UNWRITTEN_ROWS) > 0  # the capacity dropped slots
    assert torch.equal(got_y, want_y)
    for name, g in got.items():
        assert g is not None and torch.isfinite(g).all(), name
        assert torch.equal(g, want[name]), name
