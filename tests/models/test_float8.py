"""FP8 linear layers (tessera.models.float8): the products are the dequantised FP8 operands'
products, forward and backward; close to bf16 (FP8's few mantissa bits) but not bf16 itself;
conversion keeps every parameter name and leaves the head, router and experts alone (the trainer
with `train.fp8=true`: tests/train/test_precision.py). `torch._scaled_mm` runs on the CPU too, so all of this
runs here; FP8 speed is a GPU matter (tests/gpu, bench/gpu_train.py --fp8)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.models.float8 import E4M3, E5M2, Float8Linear, convert_to_float8, to_float8
from tests.train.runs import TINY_DENSE, TINY_MOE


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _dequantised(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t8, inv = to_float8(t, dtype)
    return t8.float() * inv


@pytest.mark.parametrize("rows", [32, 5], ids=["aligned", "rows-padded"])
def test_products_are_those_of_the_dequantised_fp8_operands(rows):
    """y = x8 W8^T, dx = g8 W8, dW = g8^T x8 with E4M3 x, W and E5M2 g, each scaled by its own amax;
    5 rows: the weight gradient's inner dimension is padded to 16 with zero rows."""
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen) * 3)
    x = (torch.randn(rows, 64, generator=gen) * 0.01).requires_grad_()
    g = torch.randn(rows, 48, generator=gen) * 1e-4
    y = Float8Linear.from_linear(linear)(x)
    y.backward(g)
    xq, wq, gq = _dequantised(x.detach(), E4M3), _dequantised(linear.weight.detach(), E4M3), _dequantised(g, E5M2)
    torch.testing.assert_close(y, xq @ wq.T, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(linear.weight.grad, gq.T @ xq, rtol=1e-5, atol=1e-9)


def test_under_autocast_fp8_is_near_bf16_and_keeps_its_dtypes():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    fp8 = Float8Linear.from_linear(linear)
    assert fp8.weight is linear.weight and fp8.bias is linear.bias
    x = torch.randn(2, 16, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = fp8(x), linear(x_ref)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and y.shape == y_ref.shape
    grad = torch.randn_like(y)
    y.backward(grad)
    w_grad = linear.weight.grad
    linear.weight.grad = None
    y_ref.backward(grad)
    assert x.grad.dtype == torch.float32 and w_grad.dtype == torch.float32
    # E4M3 keeps 3 mantissa bits, E5M2 2: a few percent, far more than bf16's rounding (~0.4%)
    for got, want in ((y, y_ref), (x.grad, x_ref.grad), (w_grad, linear.weight.grad)):
        assert 0.01 < _rel(got, want) < 0.1


def test_an_all_zero_operand_gives_zeros_not_nan():
    linear = Float8Linear.from_linear(nn.Linear(32, 16, bias=False))
    x = torch.zeros(4, 32, requires_grad=True)
    y = linear(x)
    y.backward(torch.zeros_like(y))
    assert not y.any() and not x.grad.any() and torch.isfinite(linear.weight.grad).all()


@pytest.mark.parametrize("config", [TINY_DENSE, TINY_MOE], ids=["dense", "moe"])
def test_conversion_keeps_names_and_leaves_head_router_and_experts(config):
    model = Transformer(load_config(config).model, init_seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_to_float8(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert fp8 == {n for n in converted}
    assert {n.split(".", 2)[2] for n in fp8} >= {"attention.wq", "attention.wk", "attention.wv", "attention.wo"}
    assert all(n.startswith("layers.") for n in fp8)  # the LM head is not converted
    if config == TINY_DENSE:
        assert len(fp8) == 7 * len(model.layers)  # 4 attention + 3 MLP projections per block
    else:  # the router and the grouped experts are not nn.Linear layers and stay as they are
        assert not any(".moe.router" in n or ".moe.experts" in n for n in fp8)


def test_a_compiled_fp8_layer_is_one_graph_and_matches_eager():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    fp8 = Float8Linear.from_linear(linear)

    def loss(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return nn.functional.silu(fp8(x)).float().square().sum()

    x = torch.randn(4, 16, 64, requires_grad=True)
    eager = loss(x)
    eager.backward()
    x_grad, w_grad = x.grad, linear.weight.grad
    x.grad = linear.weight.grad = None
    compiled = torch.compile(loss, fullgraph=True)(x)  # fullgraph: a graph break fails here
    compiled.backward()
    # the compiled kernels scale and round a few elements to the neighbouring FP8 value
    assert _rel(compiled, eager) < 1e-2
    assert _rel(x.grad, x_grad) < 5e-2 and _rel(linear.weight.grad, w_grad) < 5e-2


class _ScaledMatmuls(TorchDispatchMode):
    """Records each `_scaled_mm` call's operands and checks them against cuBLASLt's rules on CUDA
    (the CPU kernel is laxer): first operand row-major, second column-major, the inner dimension
    and the second operand's outer dimension multiples of 16."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            a, b = args[0], args[1]
            assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
            assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_every_product_takes_the_layouts_cuda_requires_even_from_a_strided_input():
    linear = Float8Linear.from_linear(nn.Linear(48, 32))
    x = torch.randn(1, 48, 5).transpose(1, 2).requires_grad_()  # [1, 5, 48], column-major rows
    with _ScaledMatmuls() as mode:
        y = linear(x)
        y.backward(torch.randn_like(y))
    assert mode.calls == 3  # y, dx, dW
    ref = nn.functional.linear(x.detach(), linear.weight, linear.bias)
    assert _rel(y.detach(), ref) < 0.1


def test_the_weight_is_saved_as_given_not_as_a_second_fp8_copy():
    """Under FSDP the weight a layer is given is the all-gathered parameter, freed after forward and
    gathered again for backward: a saved FP8 copy would keep it alive in between."""
    linear = Float8Linear.from_linear(nn.Linear(64, 32, bias=False))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = linear(torch.randn(16, 64, requires_grad=True))
    weights = [t for t in saved if t.shape == linear.weight.shape]
    assert len(weights) == 1 and weights[0].data_ptr() == linear.weight.data_ptr()
    assert [t.dtype for t in saved if t.shape == (16, 64)] == [E4M3]  # the input, in FP8
    y.sum().backward()
    assert linear.weight.grad is not None


def test_selective_recompute_keeps_the_fp8_products():
    """Selective activation checkpointing saves matrix products, FP8 ones included: backward runs
    the two gradient products per layer and recomputes no forward product."""
    from tessera.parallel.memory.activation_checkpoint import apply_activation_checkpointing

    model = Transformer(load_config(TINY_DENSE).model, init_seed=0)
    layers = len(convert_to_float8(model))
    apply_activation_checkpointing(model, "selective")
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens).logits.float().square().mean()
    with _ScaledMatmuls() as mode:
        loss.backward()
    assert mode.calls == 2 * layers
