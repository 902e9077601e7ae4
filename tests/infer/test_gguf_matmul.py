"""The CPU kernel that multiplies by GGUF block matrices without dequantizing them
(csrc/gguf_matmul_cpu.cpp, infer/cpu/gguf_matmul.py): for every block type it serves, the product by
the dequantized weight (gguf's own values, tessera.models.gguf_blocks) within the bound the int16
rounding of the activations allows, and that product with the rounded activations to fp32 rounding;
the same bits on AVX2, on AVX-512 (VNNI, where the CPU has it: `block_isa`) and in the portable loops (for one
row of x, two, and nine; the K-quants' own super-block loop for 7, 8 and 19 rows, passes of eight), on one
thread and two, a row alone or among others; `block_isa` refusing an unknown path and capping the loops;
and GgufLinear taking it only where it is installed and serves; a layer's q, k and v (gate and up) as
one grouped product, each output the bits of its own matrix's product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessera.config.errors import ConfigError
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.gguf_matmul import (
    KINDS,
    MAX_ROWS,
    BlockGroup,
    block_isa,
    gguf_linear,
    gguf_linear_group,
    loops,
    use_block_kernels,
)
from tessera.models.gguf_blocks import BLOCKS, dequantize
from tessera.models.gguf_linear import GgufLinear
from tests.checkpoint.gguf_files import K_BLOCKS, random_k_blocks


@pytest.fixture(autouse=True)
def built(monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"


def blocks(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A [rows, cols] `kind` matrix as uint8 blocks: quantized by gguf from Gaussian weights of varied
    row scales, or random blocks with valid fp16 scales for the K types (gguf cannot quantize them)."""
    import gguf

    rng = np.random.default_rng(seed)
    if kind in K_BLOCKS:
        return torch.from_numpy(random_k_blocks(kind, rows, cols, rng))
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3.0, size=(rows, 1))
    w[0, :5] = 0.0
    return torch.from_numpy(gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind]))


def int16_rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernel rounds it (per row and 32 inputs: d = max|x| / 32767, q = round(x / d)), and
    each input's group maximum |x|."""
    groups = x.reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    # 32767 / amax divided as the kernel divides (a Python number over a tensor is its reciprocal times
    # the number in PyTorch, which can differ in the last bit and round a tie the other way)
    q = torch.round(groups * torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, 0.0))
    return (q * (amax / 32767.0)).reshape(x.shape), amax.expand_as(groups).reshape(x.shape)


@pytest.fixture(params=["avx2", "avx512"])
def vector_path(request):
    """Each vector path of the block products in turn (skipped where this CPU lacks it), put back after."""
    with loops(request.param) as taken:
        if taken != request.param:
            pytest.skip(f"this CPU has no {request.param} path of the block products")
        yield taken


def cols_of(kind: str) -> int:
    return 2 * BLOCKS[kind][0] if BLOCKS[kind][0] == 256 else 7 * 32  # two super-blocks; an odd count of blocks


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [1, 3, 17])
def test_product_equals_the_dequantized_weights_within_the_int16_rounding(kind, M):
    K, N = cols_of(kind), 13  # N: not a multiple of 8 or of the threads' shares
    raw = blocks(kind, N, K, seed=M)
    w = dequantize(kind, raw, (N, K))
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen) * torch.rand(M, K // 32, 1, generator=gen).expand(M, K // 32, 32).reshape(M, K)
    x[0, :32] = 0.0  # a group of zeros (scale 0)
    bias = torch.randn(N, generator=gen)
    y = gguf_linear(x, raw, kind, N, bias)
    slack = 2e-6 * (x.abs() @ w.abs().T) + 1e-6  # fp32 sums in another order
    # With the activations rounded as the kernel rounds them, only the order of fp32 sums differs.
    xq, amax = int16_rounded(x)
    assert ((y - F.linear(xq, w, bias)).abs() <= slack).all()
    # Against the exact activations: each input moves by at most its group's max |x| / 65534.
    error, bound = (y - F.linear(x, w, bias)).abs(), (amax / 65534) @ w.abs().T + slack
    assert (error <= bound).all(), (error / bound).max()
    assert error.max() > 0  # the bound is what is tested, not equality


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [1, 2, 9])  # one row of x, two, and past a group of four
def test_avx2_avx512_and_portable_loops_give_the_same_bits(kind, M, vector_path):
    K, N = cols_of(kind), 21  # an odd count of sub-blocks (AVX-512 takes two a pass) and of rows (pairs)
    raw, x, bias = blocks(kind, N, K, seed=4), torch.randn(M, K), torch.randn(N)
    y = gguf_linear(x, raw, kind, N, bias)
    assert torch.equal(y, gguf_linear(x, raw, kind, N, bias, portable=True))
    assert torch.equal(y, torch.cat([gguf_linear(x[i:i + 1], raw, kind, N, bias) for i in range(M)]))
    other = "avx2" if vector_path == "avx512" else "avx512"
    with loops(other):  # (the AVX2 path again where this CPU has no AVX-512)
        assert torch.equal(y, gguf_linear(x, raw, kind, N, bias))


def test_block_isa_refuses_an_unknown_path_and_caps_the_loops():
    with pytest.raises(ConfigError, match="no path 'avx1024'.*avx512, avx2, portable"):
        block_isa("avx1024")
    before = block_isa()
    assert before in ("avx512", "avx2", "portable")
    with loops("portable") as taken:
        assert taken == "portable" and block_isa() == "portable"
    assert block_isa() == before  # put back
    with loops("avx512") as taken:  # at most what the CPU has
        assert taken in ("avx512", "avx2") and (taken == "avx512") == (before == "avx512")


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K"])
def test_bits_do_not_depend_on_threads_or_the_other_rows(kind, vector_path):
    K, N = cols_of(kind), 67
    raw, x = blocks(kind, N, K, seed=6), torch.randn(17, K)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_linear(x, raw, kind, N)
        torch.set_num_threads(2)
        two = gguf_linear(x, raw, kind, N)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = torch.cat([gguf_linear(x[i:i + 1], raw, kind, N) for i in range(17)])
    assert torch.equal(one, alone)  # a decode row gets the same bits whatever else is in the step


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("M", [7, 8, 19])  # short of a pass of eight rows of x, one pass, two and a part
def test_k_quants_super_block_loop_gives_the_portable_bits_on_any_thread_count(kind, M):
    K, N = 3 * 256, 13  # an odd count of super-blocks
    raw, bias = blocks(kind, N, K, seed=M), torch.randn(N)
    x = torch.randn(M, K) * torch.rand(M, K // 32, 1).expand(M, K // 32, 32).reshape(M, K)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_linear(x, raw, kind, N, bias)
        torch.set_num_threads(2)
        two = gguf_linear(x, raw, kind, N, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, gguf_linear(x, raw, kind, N, bias, portable=True))
    assert torch.equal(one, torch.cat([gguf_linear(x[i:i + 1], raw, kind, N, bias) for i in range(M)]))
    w = dequantize(kind, raw, (N, K))
    xq, _ = int16_rounded(x)
    assert ((one - F.linear(xq, w, bias)).abs() <= 2e-6 * (x.abs() @ w.abs().T) + 1e-6).all()


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_gives_the_reference_bits(kind):
    K, N = cols_of(kind), 11
    raw = blocks(kind, N, K, seed=8)
    got = torch.ops.tessera_cpu.gguf_dequantize(raw, kind, N, K)
    assert torch.equal(got.view(torch.int32), dequantize(kind, raw, (N, K)).view(torch.int32))


def test_leading_shapes_and_refusals():
    raw = blocks("Q4_0", 5, 64, seed=1)
    x = torch.randn(2, 3, 64)
    assert torch.equal(gguf_linear(x, raw, "Q4_0", 5), gguf_linear(x.reshape(6, 64), raw, "Q4_0", 5).reshape(2, 3, 5))
    with pytest.raises(RuntimeError, match="no kernel for GGML type Q2_K"):
        gguf_linear(torch.randn(1, 256), torch.from_numpy(random_k_blocks("Q2_K", 5, 256, np.random.default_rng(0))),
                    "Q2_K", 5)
    with pytest.raises(RuntimeError, match=r"blocks hold 180 bytes, \[4, 64\] needs 144"):
        gguf_linear(torch.randn(1, 64), raw, "Q4_0", 4)


def test_gguf_linear_uses_the_kernel_once_installed_and_only_where_it_serves():
    layer = GgufLinear("Q4_1", 64, 9, bias=True, dtype=torch.float32)
    layer.blocks.copy_(blocks("Q4_1", 9, 64, seed=2))
    layer.bias.data.normal_()
    x = torch.randn(3, 64)
    with torch.no_grad():
        reference = layer(x)
        assert use_block_kernels(torch.nn.Sequential(layer)) == 1
        fused = layer(x)
        assert torch.equal(fused, gguf_linear(x, layer.blocks, "Q4_1", 9, layer.bias))
        assert not torch.equal(fused, reference)
        many = torch.randn(MAX_ROWS + 1, 64)  # a long prompt chunk: the matrix dequantized once
        torch.testing.assert_close(layer(many), F.linear(many, layer.dequantized_weight(torch.float32), layer.bias),
                                   rtol=0, atol=0)
    assert torch.equal(layer(x), reference)  # autograd on: the reference
    q2 = GgufLinear("Q2_K", 256, 4, bias=False, dtype=torch.float32)
    assert use_block_kernels(torch.nn.Sequential(q2)) == 0 and q2.fused is None


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("M", [1, 6])
def test_a_group_of_matrices_gives_each_its_own_bits_on_any_thread_count(kind, M):
    K, sizes = cols_of(kind), [24, 8, 13]  # q, k, v of unequal widths; 13: not a multiple of the threads' grain
    raws = [blocks(kind, n, K, seed=10 + i) for i, n in enumerate(sizes)]
    biases = [torch.randn(24), None, torch.randn(13)]
    x = torch.randn(M, K)
    want = torch.cat([gguf_linear(x, raw, kind, n, b) for raw, n, b in zip(raws, sizes, biases, strict=True)], dim=-1)
    bias = torch.cat([b if b is not None else torch.zeros(n) for n, b in zip(sizes, biases, strict=True)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_linear_group(x, raws, kind, sizes, bias)
        torch.set_num_threads(2)
        two = gguf_linear_group(x, raws, kind, sizes, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, want) and torch.equal(two, want)
    assert torch.equal(gguf_linear_group(x, raws, kind, sizes, bias, portable=True), want)
    with pytest.raises(RuntimeError, match=r"blocks hold \d+ bytes, \[9, \d+\] needs"):
        gguf_linear_group(x, raws, kind, [24, 8, 9])


def tiny_kept_model(tmp_path, arch: str, kinds: tuple[str, ...]):
    from tessera.checkpoint.gguf.load import load_gguf
    from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf

    return load_gguf(write_gguf(tiny_hf_model(arch, seed=5), tmp_path / f"{arch}.gguf", kinds), keep_quantized=True)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qwen2: q / k / v biases, concatenated for the group
def test_a_layers_qkv_and_gate_up_take_one_grouped_product(arch, tmp_path):
    model = tiny_kept_model(tmp_path, arch, ("Q4_1",))
    tokens = torch.randint(0, 4096, (2, 5))
    assert use_block_kernels(model) > 0
    attention, mlp = model.layers["0"].attention, model.layers["0"].feed_forward
    assert isinstance(attention.fused_qkv, BlockGroup) and isinstance(mlp.fused_gate_up, BlockGroup)
    x = torch.randn(2, 5, attention.wq.in_features)
    with torch.no_grad():
        members = (attention.wq, attention.wk, attention.wv)
        assert all(torch.equal(g, m(x)) for g, m in zip(attention.fused_qkv(x), members, strict=True))
        gate, up = mlp.fused_gate_up(x)
        assert torch.equal(gate, mlp.w1(x)) and torch.equal(up, mlp.w3(x))
        logits = model(tokens).logits
        for layer in model.layers.values():  # the members one at a time, each its own product
            a, f = layer.attention, layer.feed_forward
            a.fused_qkv = lambda x, a=a: (a.wq(x), a.wk(x), a.wv(x))
            f.fused_gate_up = lambda x, f=f: (f.w1(x), f.w3(x))
        assert torch.equal(model(tokens).logits, logits)


def test_a_group_steps_aside_for_hooks_autograd_long_chunks_and_mixed_types(tmp_path):
    model = tiny_kept_model(tmp_path, "llama", ("Q4_1",))
    use_block_kernels(model)
    group = model.layers["0"].attention.fused_qkv
    x = torch.randn(1, 3, group.members[0].in_features)
    assert group(x) is None  # autograd on
    with torch.no_grad():
        assert group(x) is not None
        assert group(torch.randn(MAX_ROWS + 1, x.shape[-1])) is None  # each member dequantizes its matrix once
        handle = group.members[1].register_forward_hook(lambda *args: None)  # (a LoRA adapter's hook)
        assert group(x) is None
        handle.remove()
    mixed = tiny_kept_model(tmp_path, "llama", ("Q4_1", "Q8_0"))  # q and k of different block types
    use_block_kernels(mixed)
    assert mixed.layers["0"].attention.fused_qkv is None
