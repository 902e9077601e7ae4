"""Tessera's own quantized layers multiplied by their codes where they lie on CPU
(tessera/infer/cpu/quant_matmul.py, csrc/quant_matmul_cpu.cpp): for int8 per channel, int4 per group
and per row, compressed-tensors' 4- and 8-bit packed codes (symmetric or with zero points, per group
or per channel) and W8A8's int8 weight, the product is bit for bit the product by the same weights
repacked into the GGUF kernel's I8 / I4 blocks (how these layers were served before: the repacking is
kept here as the oracle) and equals the product by the dequantized weight within the int16 rounding of
the activations (odd shapes, a row of zeros, a bias), the same bits on one thread and two, AVX2 and
portable, a row alone or among others; a served layer holds one copy of its codes (its tensors' bytes
are its buffers', in the engine too) and a buffer replaced later is the one read;
layouts the kernel cannot read keep the reference and say why; and the engine's greedy tokens through
the kernels equal its tokens through the dequantizing reference for int8, int4 and a compressed-tensors
directory written by the compressed-tensors library."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.infer import LLM, SamplingParams
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.gguf_matmul import MAX_ROWS, gguf_linear
from tessera.infer.cpu.quant_matmul import LAYOUTS, install, quant_linear, quant_product, use_quant_kernels
from tessera.models.int8 import Int8Linear
from tessera.models.quantized import Int4Linear
from tessera.models.stored_quant import IntQuantizedLinear, PackedIntLinear, unpack_int32
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


# Each case: a layer of awkward sizes (13 outputs; 96, 160 or 256 inputs), the layout the kernel reads its
# codes in, and the block type it was repacked into before.
CASES = {
    "int8": (lambda g: Int8Linear.from_linear(linear(13, 96, g)), "I8", "I8"),
    "int4_group128": (lambda g: Int4Linear.from_linear(linear(13, 256, g)), "P4", "I4"),
    "int4_row": (lambda g: Int4Linear.from_linear(linear(13, 96, g)), "P4", "I4"),
    "ct_w4_group32": (lambda g: packed(4, 32, True, g), "P4", "I4"),
    "ct_w4_asym_group32": (lambda g: packed(4, 32, False, g), "P4", "I4"),
    "ct_w4_asym_channel": (lambda g: packed(4, None, False, g), "P4", "I4"),
    "ct_w8_group32": (lambda g: packed(8, 32, True, g), "U8", "I8"),
    "ct_w8_asym_group32": (lambda g: packed(8, 32, False, g), "U8", "I8"),
    "ct_w8a8": (lambda g: int_quantized(True, g), "I8", "I8"),
    "ct_w8a8_asym": (lambda g: int_quantized(False, g), "I8", "I8"),
}


def dequantized(layer) -> torch.Tensor:
    """The layer's weight as its reference product uses it, fp32."""
    if isinstance(layer, Int8Linear):
        return layer.qweight.float() * layer.scale[:, None]
    return layer.dequantized_weight(torch.float32)


def _blocks(kind: str, codes: torch.Tensor, f: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """I8 / I4 blocks [out, in / 32 * bytes] from integer codes [out, in] and fp32 factors [out, in / 32]."""
    out_f, in_f = codes.shape
    v = codes.reshape(out_f, in_f // 32, 32)
    vals = v.to(torch.int8).view(torch.uint8) if kind == "I8" else \
        v.to(torch.uint8)[..., :16] | (v.to(torch.uint8)[..., 16:] << 4)
    factors = torch.stack((f.float(), c.float()), -1).contiguous().view(torch.uint8)
    return torch.cat((vals, factors), -1).reshape(out_f, -1).contiguous()


def repacked(layer) -> tuple[str, torch.Tensor]:
    """The layer repacked into the I8 / I4 blocks of csrc/gguf_matmul_cpu.cpp, as quant_matmul.py did
    before the kernel read the codes where they lie (the same operations)."""
    out_f, in_f = layer.out_features, layer.in_features

    def per_block(scale):
        return scale.float().expand(out_f, scale.shape[-1]).repeat_interleave(in_f // scale.shape[-1] // 32, dim=1)

    if isinstance(layer, Int8Linear):
        f = per_block(layer.scale[:, None])
        return "I8", _blocks("I8", layer.qweight, f, torch.zeros_like(f))
    if isinstance(layer, Int4Linear):
        f, p = per_block(layer.scale), layer.qweight
        return "I4", _blocks("I4", torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2), f, -8.0 * f)
    if isinstance(layer, PackedIntLinear):
        f, q = per_block(layer.weight_scale), unpack_int32(layer.weight_packed, layer.num_bits, in_f)
        z = torch.zeros_like(f)
        if hasattr(layer, "weight_zero_point"):
            z = per_block(unpack_int32(layer.weight_zero_point.t(), layer.num_bits, out_f).t())
        if layer.num_bits == 8:
            return "I8", _blocks("I8", q, f, -f * z)
        return "I4", _blocks("I4", q + 8, f, -f * (z + 8))
    f = per_block(layer.weight_scale)
    z = per_block(layer.weight_zero_point.float()) if hasattr(layer, "weight_zero_point") else torch.zeros_like(f)
    return "I8", _blocks("I8", layer.weight, f, -f * z)


def layout(name: str, seed: int = 0):
    layer = CASES[name][0](torch.Generator().manual_seed(seed))
    assert install(layer) is None and layer.kernel_codes.layout == CASES[name][1]
    return layer


def activations(M: int, K: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * torch.rand(M, K // 32, 1, generator=gen).expand(M, K // 32, 32).reshape(M, K)
    x[0, :32] = 0.0  # a group of zeros (scale 0)
    return x


def product(layer, x: torch.Tensor, portable: bool = False) -> torch.Tensor:
    c = layer.kernel_codes
    return quant_linear(x, getattr(layer, c.codes), c.layout, getattr(layer, c.scale).float(), layer.kernel_shift,
                        c.offset, layer.out_features, layer.bias.detach(), portable)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("M", [1, 5, 17])
def test_product_is_the_bits_of_the_repacked_blocks(name, M):
    layer = layout(name, seed=M)
    kind, blocks = repacked(layer)
    assert kind == CASES[name][2]
    x = activations(M, layer.in_features, seed=M)
    with torch.no_grad():
        y = quant_product(layer, x)
    assert torch.equal(y, gguf_linear(x, blocks, kind, layer.out_features, layer.bias.detach()))
    assert torch.equal(product(layer, x, portable=True), y)


@pytest.mark.parametrize("name", CASES)
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


@pytest.mark.parametrize("name", ["int8", "int4_group128", "ct_w4_asym_group32", "ct_w8_asym_group32"])
def test_bits_do_not_depend_on_threads_the_vector_path_or_the_other_rows(name):
    layer = layout(name, seed=5)
    x = activations(17, layer.in_features, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(layer, x)
        torch.set_num_threads(2)
        two = product(layer, x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, product(layer, x, portable=True))
    alone = torch.cat([product(layer, x[i:i + 1]) for i in range(17)])
    assert torch.equal(one, alone)


def _bytes(module: torch.nn.Module, attributes: bool) -> int:
    """Bytes of the distinct storages under `module`'s parameters and buffers (and its tensor attributes)."""
    tensors = [*module.parameters(), *module.buffers()]
    if attributes:
        tensors += [t for m in module.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("name", CASES)
def test_a_served_layer_holds_one_copy_of_its_codes(name):
    layer = CASES[name][0](torch.Generator().manual_seed(0))
    own = _bytes(layer, attributes=True)
    assert install(layer) is None
    shift = layer.kernel_shift  # a layer with zero points: -f * z, one fp32 per (row, group)
    added = 0 if shift is None else shift.numel() * 4
    assert shift is None or shift.numel() == layer.out_features * getattr(layer, layer.kernel_codes.scale).shape[-1]
    assert _bytes(layer, attributes=True) == own + added


def test_a_buffer_replaced_after_install_is_the_one_read():
    layer = layout("int4_group128")
    x = activations(2, layer.in_features, seed=1)
    other = Int4Linear.from_linear(linear(13, 256, torch.Generator().manual_seed(9)))
    layer.qweight, layer.scale, layer.bias = other.qweight, other.scale, other.bias  # as a reload would
    install(other)
    with torch.no_grad():
        assert torch.equal(quant_product(layer, x), quant_product(other, x))


def test_the_layer_takes_the_kernel_only_where_it_serves():
    layer = layout("ct_w8a8")
    x = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(layer(x), quant_product(layer, x))
        many = torch.randn(MAX_ROWS + 1, 96)  # a long prompt chunk: the reference
        assert torch.equal(layer(many), F.linear(many, dequantized(layer), layer.bias))
    assert torch.equal(layer(x), F.linear(x, dequantized(layer), layer.bias))  # autograd on


def test_layouts_the_kernel_cannot_read_keep_the_reference_and_say_why():
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
    assert set(LAYOUTS) == {Int8Linear, Int4Linear, PackedIntLinear, IntQuantizedLinear}


def _greedy_both_ways(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list, list]:
    """The engine's greedy tokens through the installed kernels, then with every seam cleared."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    quantized = [m for m in llm.engine.model.modules() if type(m) in LAYOUTS]
    assert quantized and all(m.fused is quant_product for m in quantized), "a layer did not take the kernel"
    fast = [out.token_ids for out in llm.generate(prompts, params)]
    for m in quantized:
        m.fused = None
    return fast, [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_greedy_tokens_equal_the_dequantizing_path(method, tmp_path):
    write_model(tmp_path, intermediate_size=64)  # every projection's inputs whole blocks of 32
    llm = LLM(tmp_path, block_size=4, num_blocks=64, quantization=method)
    served = [m for m in llm.engine.model.modules() if type(m) in LAYOUTS]
    assert all(_bytes(m, attributes=True) == _bytes(m, attributes=False) for m in served)  # nothing beside the codes
    fast, reference = _greedy_both_ways(llm, [[5, 9, 17, 3], list(range(20, 60))], 16)  # 40: a chunk past MAX_ROWS
    assert fast == reference


@pytest.mark.parametrize("kind", ["w4a16_asym", "w8a8_dynamic"])
def test_engine_greedy_tokens_on_a_compressed_tensors_directory(kind, tmp_path):
    from tests.checkpoint.quantized_checkpoints import write_compressed

    write_compressed(tmp_path, kind)  # by the compressed-tensors library
    llm = LLM(tmp_path, block_size=4, num_blocks=64)
    fast, reference = _greedy_both_ways(llm, [[5, 9, 17, 3, 100, 7], list(range(300, 340))], 8)
    assert fast == reference
