"""Tessera's own quantized layers multiplied by their codes on CPU (tessera/infer/cpu/quant_matmul.py,
the I8 / I4 blocks of csrc/gguf_matmul_cpu.cpp): for int8 per channel, int4 per group and per row,
compressed-tensors' 4- and 8-bit packed codes (symmetric or with zero points, per group or per
channel) and W8A8's int8 weight, the repacked blocks dequantize to the layer's own weight, the
product equals the product by the dequantized weight within the int16 rounding of the activations
(odd shapes, a row of zeros, a bias), the same bits on one thread and two, AVX2 and portable, a row
alone or among others; layouts that do not repack keep the reference and say why; and the engine's
greedy tokens through the kernels equal its tokens through the dequantizing reference for int8,
int4 and a compressed-tensors directory written by the compressed-tensors library."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.infer import LLM, SamplingParams
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.gguf_matmul import MAX_ROWS, gguf_linear
from tessera.infer.cpu.quant_matmul import REPACK, install, quant_product, use_quant_kernels
from tessera.models.int8 import Int8Linear
from tessera.models.quantized import Int4Linear
from tessera.models.stored_quant import IntQuantizedLinear, PackedIntLinear
from tests.infer.test_gguf_matmul import int16_rounded
from tests.infer.tiny_models import write_model


@pytest.fixture(autouse=True)
def built(monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"


def _random_(buffer: torch.Tensor, gen: torch.Generator) -> None:
    buffer.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, buffer.shape, generator=gen, dtype=torch.int64).to(buffer.dtype))


def linear(out_f: int, in_f: int, gen: torch.Generator) -> torch.nn.Linear:
    lin = torch.nn.Linear(in_f, out_f, bias=True)
    with torch.no_grad():  # channels of very different scales
        lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) * torch.logspace(-2, 0.5, out_f)[:, None])
        lin.bias.normal_(generator=gen)
    return lin


def packed(num_bits: int, group_size: int | None, symmetric: bool, gen, out_f=13, in_f=160) -> PackedIntLinear:
    groups = in_f // group_size if group_size else 1
    m = PackedIntLinear(in_f, out_f, True, torch.float32, num_bits, groups, group_size, symmetric, g_idx=False)
    _random_(m.weight_packed, gen)  # every field of every word is some code
    m.weight_scale.copy_(torch.rand(m.weight_scale.shape, generator=gen) * 0.1 + 1e-3)
    if not symmetric:
        _random_(m.weight_zero_point, gen)
    m.bias.data.normal_(generator=gen)
    return m


def int_quantized(symmetric: bool, gen, out_f=13, in_f=96) -> IntQuantizedLinear:
    m = IntQuantizedLinear(in_f, out_f, True, torch.float32, per_channel=True, symmetric=symmetric, act=None)
    m.weight.copy_(torch.randint(-128, 128, m.weight.shape, generator=gen).to(torch.int8))
    m.weight_scale.copy_(torch.rand(out_f, 1, generator=gen) * 0.05 + 1e-3)
    if not symmetric:
        m.weight_zero_point.copy_(torch.randint(-20, 20, (out_f, 1), generator=gen).to(torch.int8))
    m.bias.data.normal_(generator=gen)
    return m


# Each layout: a layer of awkward sizes (13 outputs; 96, 160 or 256 inputs), and the block type it repacks to.
LAYOUTS = {
    "int8": (lambda g: Int8Linear.from_linear(linear(13, 96, g)), "I8"),
    "int4_group128": (lambda g: Int4Linear.from_linear(linear(13, 256, g)), "I4"),
    "int4_row": (lambda g: Int4Linear.from_linear(linear(13, 96, g)), "I4"),
    "ct_w4_group32": (lambda g: packed(4, 32, True, g), "I4"),
    "ct_w4_asym_group32": (lambda g: packed(4, 32, False, g), "I4"),
    "ct_w4_asym_channel": (lambda g: packed(4, None, False, g), "I4"),
    "ct_w8_group32": (lambda g: packed(8, 32, True, g), "I8"),
    "ct_w8_asym_group32": (lambda g: packed(8, 32, False, g), "I8"),
    "ct_w8a8": (lambda g: int_quantized(True, g), "I8"),
    "ct_w8a8_asym": (lambda g: int_quantized(False, g), "I8"),
}


def dequantized(layer) -> torch.Tensor:
    """The layer's weight as its reference product uses it, fp32."""
    if isinstance(layer, Int8Linear):
        return layer.qweight.float() * layer.scale[:, None]
    return layer.dequantized_weight(torch.float32)


def layout(name: str, seed: int = 0):
    layer = LAYOUTS[name][0](torch.Generator().manual_seed(seed))
    assert install(layer) is None and layer.kernel_kind == LAYOUTS[name][1]
    return layer


def activations(M: int, K: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * torch.rand(M, K // 32, 1, generator=gen).expand(M, K // 32, 32).reshape(M, K)
    x[0, :32] = 0.0  # a group of zeros (scale 0)
    return x


@pytest.mark.parametrize("name", LAYOUTS)
def test_blocks_dequantize_to_the_layers_weight(name):
    layer = layout(name)
    w = dequantized(layer)
    got = torch.ops.tessera_cpu.gguf_dequantize(layer.kernel_blocks, layer.kernel_kind, *w.shape)
    # f * w + c against the layer's (q - z) * s: the same value but for fp32 rounding
    torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6 * w.abs().amax().item())


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("M", [1, 3, 17])
def test_product_equals_the_dequantized_weight_within_the_int16_rounding(name, M):
    layer = layout(name, seed=M)
    w, bias = dequantized(layer), layer.bias.detach()
    x = activations(M, layer.in_features, seed=M)
    with torch.no_grad():
        y = quant_product(layer, x)
    slack = 2e-6 * (x.abs() @ w.abs().T) + 1e-6  # fp32 sums in another order
    xq, amax = int16_rounded(x)
    assert ((y - F.linear(xq, w, bias)).abs() <= slack).all()
    error, bound = (y - F.linear(x, w, bias)).abs(), (amax / 65534) @ w.abs().T + slack
    assert (error <= bound).all(), (error / bound).max()
    assert error.max() > 0  # the bound is what is tested, not equality


@pytest.mark.parametrize("name", ["int8", "int4_group128", "ct_w4_asym_group32"])
def test_bits_do_not_depend_on_threads_the_vector_path_or_the_other_rows(name):
    layer = layout(name, seed=5)
    x, kind, N = activations(17, layer.in_features, seed=5), layer.kernel_kind, layer.out_features
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_linear(x, layer.kernel_blocks, kind, N)
        torch.set_num_threads(2)
        two = gguf_linear(x, layer.kernel_blocks, kind, N)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, gguf_linear(x, layer.kernel_blocks, kind, N, portable=True))
    alone = torch.cat([gguf_linear(x[i:i + 1], layer.kernel_blocks, kind, N) for i in range(17)])
    assert torch.equal(one, alone)


def test_the_layer_takes_the_kernel_only_where_it_serves():
    layer = layout("ct_w8a8")
    x = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(layer(x), quant_product(layer, x))
        many = torch.randn(MAX_ROWS + 1, 96)  # a long prompt chunk: the reference
        assert torch.equal(layer(many), F.linear(many, dequantized(layer), layer.bias))
    assert torch.equal(layer(x), F.linear(x, dequantized(layer), layer.bias))  # autograd on


def test_layouts_that_do_not_repack_keep_the_reference_and_say_why():
    gen = torch.Generator().manual_seed(0)
    odd = Int8Linear.from_linear(linear(5, 48, gen))
    small_groups = packed(4, 16, True, gen, in_f=96)
    g_idx = PackedIntLinear(64, 5, False, torch.float32, 4, 2, 32, True, g_idx=True)
    model = torch.nn.ModuleDict({"odd": odd, "small": small_groups, "g_idx": g_idx, "int4": layout("int4_row")})
    done, skipped = use_quant_kernels(model)
    assert done == 1 and set(skipped) == {"odd", "small", "g_idx"}
    assert skipped["odd"] == "in_features=48 is not a multiple of 32"
    assert "groups of 16 over in_features=96" in skipped["small"]
    assert "weight_g_idx" in skipped["g_idx"]
    assert odd.fused is None and small_groups.fused is None and g_idx.fused is None
    assert set(REPACK) == {Int8Linear, Int4Linear, PackedIntLinear, IntQuantizedLinear}


def _greedy_both_ways(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list, list]:
    """The engine's greedy tokens through the installed kernels, then with every seam cleared."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    quantized = [m for m in llm.engine.model.modules() if type(m) in REPACK]
    assert quantized and all(m.fused is quant_product for m in quantized), "a layer did not take the kernel"
    fast = [out.token_ids for out in llm.generate(prompts, params)]
    for m in quantized:
        m.fused = None
    return fast, [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_greedy_tokens_equal_the_dequantizing_path(method, tmp_path):
    write_model(tmp_path, intermediate_size=64)  # every projection's inputs whole blocks of 32
    llm = LLM(tmp_path, block_size=4, num_blocks=64, quantization=method)
    fast, reference = _greedy_both_ways(llm, [[5, 9, 17, 3], list(range(20, 60))], 16)  # 40: a chunk past MAX_ROWS
    assert fast == reference


@pytest.mark.parametrize("kind", ["w4a16_asym", "w8a8_dynamic"])
def test_engine_greedy_tokens_on_a_compressed_tensors_directory(kind, tmp_path):
    from tests.checkpoint.quantized_checkpoints import write_compressed

    write_compressed(tmp_path, kind)  # by the compressed-tensors library
    llm = LLM(tmp_path, block_size=4, num_blocks=64)
    fast, reference = _greedy_both_ways(llm, [[5, 9, 17, 3, 100, 7], list(range(300, 340))], 8)
    assert fast == reference
