"""A pre-quantized directory's sizes and types are untrusted input: a block-FP8 `weight_block_size`
far larger than the weights never asks for more memory than the weights, and an FP8 scheme whose
codes (or whose config's weight type) say int8 is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.checkpoint.loading import load_model
from tessera.config.errors import CheckpointError, ConfigError
from tests.checkpoint.quantized_checkpoints import edited_quantization_config, write_block_fp8, write_compressed

IDS = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(5))


def _edited(source, tmp_path, edit):
    tmp_path.mkdir(exist_ok=True)
    return edited_quantization_config(source, tmp_path / "edited", edit)


def _one_block(codes: torch.Tensor, scale: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 codes and scales requantized with one scale for the whole weight."""
    w = codes.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:codes.shape[0], :codes.shape[1]]
    one = w.abs().amax().clamp(min=1e-12) / 448.0
    return (w / one).to(torch.float8_e4m3fn), one.reshape(1, 1)


def test_a_huge_weight_block_size_is_one_block_not_terabytes(tmp_path):
    """weight_block_size [2^40, 2^40] and one scale per weight: each weight is one block, as with a
    block just larger than every weight ([4096, 4096]); dequantizing it once asked for 4 TB."""
    write_block_fp8(tmp_path / "m", block=(16, 16))
    stored = load_file(str(tmp_path / "m" / "model.safetensors"))
    for key in [k for k in stored if k.endswith(".weight_scale_inv")]:
        weight = key.removesuffix("_scale_inv")
        stored[weight], stored[key] = _one_block(stored[weight], stored[key], 16)
    save_file(stored, str(tmp_path / "m" / "model.safetensors"))
    out = {}
    for block in (4096, 2**40):
        path = _edited(tmp_path / "m", tmp_path / str(block), lambda qc, b=block: qc.update(weight_block_size=[b, b]))
        model = load_model(path).model
        with torch.no_grad():
            out[block] = model(IDS).logits
    torch.testing.assert_close(out[2**40], out[4096], rtol=0, atol=0)
    layer = model.layers["0"].attention.wq
    assert layer.block == (layer.out_features, layer.in_features)


def test_fp8_codes_stored_as_int8_are_refused_naming_the_tensor(tmp_path):
    write_compressed(tmp_path, "fp8_channel_dynamic")
    stored = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    stored[key] = stored[key].float().clamp(-127, 127).to(torch.int8)
    save_file(stored, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{key}' is int8; the scheme stores it as float8_e4m3fn"):
        load_model(tmp_path)


@pytest.mark.parametrize("kind, fmt, weight_type", [("fp8_channel_dynamic", "float-quantized", "int"),
                                                     ("w8a8_dynamic", "int-quantized", "float")])
def test_a_format_whose_weight_type_says_otherwise_is_refused(tmp_path, kind, fmt, weight_type):
    write_compressed(tmp_path / "m", kind)

    def edit(qc):
        qc["config_groups"]["group_0"]["weights"]["type"] = weight_type

    with pytest.raises(ConfigError, match=f"format {fmt} with weights type='{weight_type}' is not supported"):
        load_model(_edited(tmp_path / "m", tmp_path, edit))
