"""Tessera's torch dequantizers of GGML block types give exactly gguf's own `gguf.quants.dequantize`
values (bit-identical float32) for matrices of several rows and several blocks per row: weights
quantized by gguf where it can quantize the type, random blocks with valid fp16 scales for the
K types (which gguf only dequantizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.models.gguf_blocks import BLOCKS, dequantize, row_bytes
from tessera.models.gguf_linear import GgufLinear
from tests.checkpoint.gguf_files import K_BLOCKS, random_k_blocks

SHAPES = [(1, 256), (3, 768), (7, 512)]  # one block row; several rows and blocks; an odd row count


def _blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    import gguf

    rng = np.random.default_rng(seed)
    if kind in K_BLOCKS:
        return random_k_blocks(kind, rows, cols, rng)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3.0, size=(rows, 1))
    w[0, :5] = 0.0  # a block with zeros in it
    return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_dequantize_equals_gguf_bit_for_bit(kind, shape):
    import gguf

    raw = _blocks(kind, *shape, seed=hash((kind, shape)) % 2**32)
    assert raw.shape == (shape[0], row_bytes(kind, shape[1]))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    got = dequantize(kind, torch.from_numpy(raw), shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))  # every bit, -0.0 and NaN too


def test_random_bytes_of_the_simple_types_too():
    """Any bit pattern of a Q4_0..Q8_0 block (with a finite fp16 scale) dequantizes as gguf's does,
    not only the ones gguf's quantizer writes (every high bit set or clear, negative minimums)."""
    import gguf

    rng = np.random.default_rng(5)
    for kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        size, nbytes = BLOCKS[kind]
        raw = rng.integers(0, 256, size=(4, 3 * nbytes), dtype=np.uint8)
        blocks = raw.reshape(4, 3, nbytes)
        for at in (0, 2) if kind in ("Q4_1", "Q5_1") else (0,):
            scale = rng.uniform(-2, 2, size=(4, 3)).astype(np.float16)
            blocks[:, :, at:at + 2] = scale.view(np.uint8).reshape(4, 3, 2)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
        got = dequantize(kind, torch.from_numpy(raw), (4, 3 * size)).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), kind


def test_gguf_linear_multiplies_by_the_dequantized_weight():
    raw = _blocks("Q4_K", 5, 512, seed=1)
    layer = GgufLinear("Q4_K", 512, 5, bias=True, dtype=torch.float32)
    layer.blocks.copy_(torch.from_numpy(raw))
    layer.bias.data.normal_()
    x = torch.randn(3, 512)
    w = dequantize("Q4_K", layer.blocks, (5, 512))
    torch.testing.assert_close(layer(x), x @ w.T + layer.bias, rtol=0, atol=1e-5)
    layer.bias = None  # a bf16 model's layer: its product in bf16, from the same float32 dequantized weight
    torch.testing.assert_close(layer(x.bfloat16()), (x.bfloat16() @ w.bfloat16().T), rtol=0, atol=0)
    assert layer.blocks.nbytes == raw.nbytes == 5 * 2 * 144  # the file's bytes, not 4 per weight


def test_wrong_sizes_and_types_are_refused_by_name():
    with pytest.raises(ValueError, match="Q4_0 rows hold whole blocks of 32 values; 40 is not a multiple"):
        row_bytes("Q4_0", 40)
    with pytest.raises(ValueError, match=r"Q8_0 \[2, 32\] needs 68 uint8 bytes; got 34"):
        dequantize("Q8_0", torch.zeros(34, dtype=torch.uint8), (2, 32))
    with pytest.raises(ValueError, match="GGML type 'IQ4_NL' has no torch dequantizer; supported: Q8_0"):
        GgufLinear("IQ4_NL", 32, 2, bias=False, dtype=torch.float32)


def test_mxfp4_blocks_with_every_scale_byte_equal_gguf():
    """Random MXFP4 blocks (every bit pattern is one), the scale bytes 0 and 1 (subnormal scales) among them."""
    import gguf

    raw = np.random.default_rng(0).integers(0, 256, size=(6, 17 * 3), dtype=np.uint8)
    raw[:, 0] = [0, 1, 2, 127, 128, 254]
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
    got = dequantize("MXFP4", torch.from_numpy(raw), (6, 96))
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
