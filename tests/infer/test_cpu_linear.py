"""The panel kernel of a served model's projections on CPU (csrc/linear_cpu.cpp) against F.linear, and
the oneDNN packing that serves where the kernel is switched off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.infer import LLM, SamplingParams
from tessera.infer.config import EngineConfig
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.linear import FusedLinear, OneDNNLinear, PanelLinear, fuse_projections, pack_linears
from tests.infer.tiny_models import write_model


@pytest.fixture
def ops(monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"
    return torch.ops.tessera_cpu


# rows: fewer than one register block, one, one and a remainder of each size, blocks of unequal
# sizes (13: 5+4+4, 32: 6+6+5+5+5+5), one row past the last count that prefetches the next panel
# (97), many; columns: whole panels, a last panel of 1 and of 15 columns, fewer than one panel
@pytest.mark.parametrize("M", [1, 5, 6, 7, 8, 11, 13, 32, 64, 97, 300])
@pytest.mark.parametrize("K,N", [(64, 32), (24, 17), (40, 31), (8, 5), (96, 48), (600, 20)])
def test_panel_linear_equals_f_linear(ops, M, K, N):
    gen = torch.Generator().manual_seed(M * 1000 + K + N)
    w, b = torch.randn(N, K, generator=gen) * K**-0.5, torch.randn(N, generator=gen)  # outputs of unit scale
    x = torch.randn(M, K, generator=gen)
    panels = ops.pack_panels(w)
    assert panels.shape == (-(-N // 16), K, 16)
    torch.testing.assert_close(ops.panel_linear(x, panels, b, N), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.panel_linear(x, panels, None, N), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_panel_linear_takes_any_leading_shape_and_strided_rows(ops):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(20, 12, generator=gen)
    panels = ops.pack_panels(w)
    x = torch.randn(2, 3, 12, generator=gen)
    out = ops.panel_linear(x, panels, None, 20)
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    wide = torch.randn(5, 36, generator=gen)  # rows of a wider product: a strided view
    torch.testing.assert_close(ops.panel_linear(wide[:, 12:24], panels, None, 20), F.linear(wide[:, 12:24], w),
                               rtol=1e-5, atol=1e-5)
    assert ops.panel_linear(torch.empty(0, 12), panels, None, 20).shape == (0, 20)


def test_panel_linear_refuses_what_it_cannot_compute(ops):
    panels = ops.pack_panels(torch.randn(20, 12))
    with pytest.raises(RuntimeError, match="fp32 CPU"):
        ops.panel_linear(torch.randn(3, 12).bfloat16(), panels, None, 20)
    with pytest.raises(RuntimeError, match="last dim must be 12"):
        ops.panel_linear(torch.randn(3, 10), panels, None, 20)
    with pytest.raises(RuntimeError, match="does not match 2 panels"):
        ops.panel_linear(torch.randn(3, 12), panels, None, 40)
    with pytest.raises(RuntimeError, match=r"bias must be fp32 \[20\]"):
        ops.panel_linear(torch.randn(3, 12), panels, torch.randn(19), 20)
    with pytest.raises(RuntimeError, match="pack_panels takes an fp32 CPU weight"):
        ops.pack_panels(torch.randn(4, 4).double())


def test_without_the_library_projections_pack_for_onednn(tmp_path, monkeypatch):
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setenv(cpu_attention.ENV, "torch")  # the switch that keeps the C++ library out
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    x = torch.randn(5, 3, 24)
    want = model(x)
    assert pack_linears(model) == 2 and all(type(m) is OneDNNLinear for m in (model[0], model[2]))
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    # an engine served so: oneDNN's products, PyTorch's norms and attention, the same greedy tokens
    write_model(tmp_path, "qwen2")  # q/k/v biases through the fused product
    config = dict(block_size=4, max_num_seqs=8, enable_prefix_caching=False)
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6][:n] for n in (1, 3, 9, 6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    onednn = LLM(str(tmp_path), EngineConfig(**config))
    attention = onednn.engine.executor.model.layers["0"].attention
    assert isinstance(attention.fused_qkv, FusedLinear) and attention.fused_qkv.multiply.__name__ == "_onednn_multiply"
    plain = LLM(str(tmp_path), EngineConfig(cpu_prepack=False, **config))
    got = [o.token_ids for o in onednn.generate(prompts, params)]
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    monkeypatch.delenv(cpu_attention.ENV)
    panels = LLM(str(tmp_path), EngineConfig(**config))
    assert type(panels.engine.executor.model.output) is PanelLinear
    assert got == [o.token_ids for o in panels.generate(prompts, params)]


def test_fused_projections_need_members_packed_alike(ops):
    from tessera.models.mlp import FeedForward

    mlp = FeedForward(16, 24)
    pack_linears(mlp)
    assert type(mlp.w1) is PanelLinear
    mlp.w3.__class__ = OneDNNLinear  # packed another way: not fused
    assert fuse_projections(mlp) == 0 and mlp.fused_gate_up is None


# rows as above; the hidden size one panel pair, three, and a K that is not a multiple of 8
@pytest.mark.parametrize("M", [1, 5, 13, 32, 97, 300])
@pytest.mark.parametrize("K,F_", [(64, 16), (24, 48), (37, 32)])
def test_panel_swiglu_gives_the_bits_of_the_product_then_silu_mul(ops, M, K, F_):
    gen = torch.Generator().manual_seed(M * 100 + K + F_)
    w = torch.randn(2 * F_, K, generator=gen) * K**-0.5  # [gate; up]
    x = torch.randn(M, K, generator=gen)
    panels = ops.pack_panels(w)
    gate_up = ops.panel_linear(x, panels, None, 2 * F_)
    want = ops.silu_mul(gate_up[:, :F_], gate_up[:, F_:])
    got = ops.panel_swiglu(x, panels, F_)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, F.silu(F.linear(x, w[:F_])) * F.linear(x, w[F_:]), rtol=1e-5, atol=1e-5)
    assert ops.panel_swiglu(x.reshape(1, M, K), panels, F_).shape == (1, M, F_)


def test_panel_swiglu_refuses_what_it_cannot_compute(ops):
    panels = ops.pack_panels(torch.randn(64, 12))
    with pytest.raises(RuntimeError, match="must be a multiple of 16 and half the 64"):
        ops.panel_swiglu(torch.randn(3, 12), panels, 16)
    with pytest.raises(RuntimeError, match="must be a multiple of 16"):
        ops.panel_swiglu(torch.randn(3, 12), ops.pack_panels(torch.randn(40, 12)), 20)
    with pytest.raises(RuntimeError, match="last dim must be 12"):
        ops.panel_swiglu(torch.randn(3, 10), panels, 32)
    with pytest.raises(RuntimeError, match="fp32 CPU"):
        ops.panel_swiglu(torch.randn(3, 12).double(), panels, 32)


def test_the_swiglu_epilogue_serves_an_mlp_and_steps_aside_for_hooks_and_autograd(ops):
    from tessera.infer.cpu.layer_ops import fuse_layer_ops, unfuse_layer_ops
    from tessera.models.mlp import FeedForward

    torch.manual_seed(0)
    mlp = FeedForward(24, 32)
    x = torch.randn(2, 7, 24)
    with torch.no_grad():
        want = mlp.w2(F.silu(mlp.w1(x)) * mlp.w3(x))
    pack_linears(mlp)
    fuse_projections(mlp)
    assert mlp.fused_gate_up.has_swiglu and fuse_layer_ops(mlp) == 1
    assert mlp.fused_swiglu == mlp.fused_gate_up.swiglu
    with torch.no_grad():
        got = mlp(x)
        gate, up = mlp.fused_gate_up(x)
        assert torch.equal(mlp.fused_swiglu(x), ops.silu_mul(gate, up))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    seen = []
    handle = mlp.w1.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        assert mlp.fused_swiglu(x) is None  # the hook must see w1's own call
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    assert seen == [(2, 7, 32)]
    handle.remove()
    assert mlp.fused_swiglu(x.requires_grad_()) is None  # autograd: the fused product steps aside too
    assert mlp.fused_gate_up(x) is None
    unfuse_layer_ops(mlp)
    assert mlp.fused_swiglu is None and mlp.fused_act is None


@pytest.mark.parametrize("sizes,bias,onednn", [((32, 16), False, False), ((24, 24), False, False),
                                               ((32, 32), True, False), ((32, 32), False, True)])
def test_the_swiglu_epilogue_needs_equal_sizes_of_whole_panels_without_bias_on_the_panel_kernel(
        ops, sizes, bias, onednn):
    if onednn and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    members = [nn.Linear(8, n, bias=bias) for n in sizes]
    for m in members:
        m.packed = (OneDNNLinear if onednn else PanelLinear).pack(m.weight.detach())
        m.__class__ = OneDNNLinear if onednn else PanelLinear
    assert not FusedLinear(members).has_swiglu
