"""The one-process MoE step never needs a value from the device on the host.

A GPU step that reads a token count on the host (`.item()`, `.tolist()`, `int(tensor)`, boolean
indexing, `bincount`: an output whose size depends on the data) waits for every kernel queued
before it. The guard here is FakeTensor tracing (`make_fx(tracing_mode="fake")`): tensors carry
shapes but no values, so any such read fails the trace, and the traced graph lists every op the
forward and backward ran, so ops whose output size depends on the data are refused by name too.
`torch._grouped_mm`'s fake rule accepts only bf16 on this torch: the layer runs in bf16, as on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from tessera.config.model import MoEConfig
from tessera.models.moe.capacity import capacity_keep_mask, expert_capacity
from tessera.models.moe.layer import MoE

# ops that read device values on the host, or whose output size depends on them
HOST_SYNC_OPS = ("_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique",
                 "repeat_interleave", "_assert_async")

LAYERS = {
    "dropless": {},
    "capacity-probs": {"capacity_factor": 1.0},
    "capacity-position-padded": {"capacity_factor": 0.75, "drop_policy": "position", "pad_to_capacity": True},
    "shared-and-every-loss": {"shared_ffn_dim": 32, "shared_expert_gate": True, "seq_aux_loss_coef": 0.01,
                              "z_loss_coef": 0.001, "capacity_factor": 1.25},
}


def _moe(dtype=torch.bfloat16, **changes) -> MoE:
    cfg = MoEConfig(**{"num_experts": 4, "top_k": 2, "ffn_dim": 32, "aux_loss_coef": 0.01, **changes})
    layer = MoE(64, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer.to(dtype).train()


def _step_graph(layer: MoE, x: torch.Tensor) -> torch.fx.GraphModule:
    """Forward + backward of the layer (loss: output and balancing losses) traced on fake tensors."""
    names = [n for n, _ in layer.named_parameters()]

    def step(x, *params):
        y, route = torch.func.functional_call(layer, dict(zip(names, params, strict=True)), (x,))
        loss = y.float().square().sum() + sum(route.losses.values())
        return torch.autograd.grad(loss, (x, *params))

    return make_fx(step, tracing_mode="fake")(x.requires_grad_(), *layer.parameters())


@pytest.mark.parametrize("changes", LAYERS.values(), ids=LAYERS.keys())
def test_moe_forward_backward_has_no_host_synchronisation(changes):
    graph = _step_graph(_moe(**changes), torch.randn(2, 8, 64, dtype=torch.bfloat16))
    ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert not [op for op in ops if any(s in op for s in HOST_SYNC_OPS)], sorted(set(ops))
    assert sum("_grouped_mm" in op for op in ops) >= 3 * 3  # 3 expert GEMMs, forward and 2 backward each


def test_the_guard_catches_a_host_read():
    """The trace fails on a token count read on the host, the sync the layer used to have."""
    layer = _moe(capacity_factor=1.0)
    layer.capacity = lambda route: expert_capacity(int(route.counts_E.sum().item()) // 2, 4, 2, 1.0)
    with pytest.raises(Exception, match="(?i)data.dependent|item|scalar"):
        _step_graph(layer, torch.randn(2, 8, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("padded", [False, True], ids=["dropped", "padded"])
def test_dropped_slots_get_no_output_and_no_gradient(padded):
    """fp32: output and every gradient of a capacity layer equal a slot-by-slot reference over the
    kept slots only (the dropped slots' rows that stay in place after the last expert's add nothing)."""
    layer = _moe(torch.float32, capacity_factor=0.5, drop_policy="probs", pad_to_capacity=padded)
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y, route = layer(x)
    y.square().sum().backward()
    got = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    layer.zero_grad(set_to_none=True)
    x.grad = None
    keep = capacity_keep_mask(route.indices_Tk, route.weights_Tk, 4, expert_capacity(12, 4, 2, 0.5), "probs")
    assert 0 < keep.sum() < keep.numel()
    x_TD, ex = x.view(12, 64), layer.experts
    route = layer.router(x_TD, (1, 12))
    rows = []
    for t in range(12):
        row = torch.zeros(64)
        for s in range(2):
            if keep[t, s]:
                e = route.indices_Tk[t, s]
                h = F.silu(x_TD[t] @ ex.w1[e].T) * (x_TD[t] @ ex.w3[e].T)
                row = row + route.weights_Tk[t, s] * (h @ ex.w2[e].T)
        rows.append(row)
    want_y = torch.stack(rows)
    want_y.square().sum().backward()
    torch.testing.assert_close(y.view(12, 64), want_y, rtol=1e-5, atol=1e-6)
    want = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    for name, g in got.items():
        torch.testing.assert_close(g, want[name] if want[name] is not None else torch.zeros_like(g),
                                   rtol=1e-5, atol=1e-6, msg=name)
