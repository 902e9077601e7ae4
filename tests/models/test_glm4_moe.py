"""GLM-4.5 (glm4_moe) beyond the shared family tests: its presets' published sizes, partial rotary
(RoPE on a share of each head, the rest passed through) and what an export refuses by name."""

from dataclasses import replace

import pytest
import torch

from tessera.config import ConfigError, ModelConfig, ModelError, get_preset
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.models.counting import count_params
from tessera.models.rope import apply_rope, rope_cos_sin, rope_frequencies


def test_published_parameter_counts():
    # GLM-4.5: 355B total with its MTP layer (not counted here), 32B active; GLM-4.5-Air: 106B / 12B
    assert round(count_params(get_preset("glm-4.5")) / 1e9) == 353
    assert round(count_params(get_preset("glm-4.5-air")) / 1e9) == 107
    assert round(count_params(get_preset("glm-4.5-air"), active=True) / 1e9) == 13


@pytest.mark.parametrize("name", ["glm-4.5", "glm-4.5-air", "tiny-glm4-moe"])
def test_presets_round_trip_through_config_json_whole(name):
    cfg = get_preset(name)
    d = config_to_hf(cfg)
    assert d["partial_rotary_factor"] == 0.5 and d["attention_bias"] is True
    assert config_from_hf(d) == cfg


def test_partial_rotary_turns_the_first_dimensions_and_passes_the_rest():
    inv_freq, _ = rope_frequencies(4, 10000.0)
    cos, sin = rope_cos_sin(torch.arange(5)[None], inv_freq, 1.0, torch.float32)
    x = torch.randn(1, 5, 2, 10)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :4], apply_rope(x[..., :4].contiguous(), cos, sin))
    assert not torch.allclose(out[0, 1:, :, :4], x[0, 1:, :, :4])


def test_a_partial_rotary_model_exports_only_as_a_family_that_has_it():
    cfg = get_preset("tiny-llama", partial_rotary_factor=0.5)
    with pytest.raises(ModelError, match=r"llama has no such part \(model.partial_rotary_factor=0.5, its class needs "
                                         r"1.0\); export it as phi3, glm4_moe or qwen3_next"):
        config_to_hf(cfg)
    with pytest.raises(ModelError, match=r"glm4_moe's output projection has no bias \(model.out_bias must be false"):
        config_to_hf(replace(get_preset("tiny-glm4-moe"), out_bias=True))


@pytest.mark.parametrize("factor", [0.0, 1.5, 0.1])
def test_a_partial_rotary_factor_that_rotates_no_even_share_is_refused(factor):
    with pytest.raises(ConfigError, match=rf"model.partial_rotary_factor={factor} is invalid: must be in \(0, 1\]"):
        ModelConfig(family="llama", dim=64, n_heads=4, partial_rotary_factor=factor)


def test_the_stored_mtp_layer_is_left_unread_as_transformers_leaves_it(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from tessera.hf import load_pretrained
    from tests.models.hf_families import hf_configs, random_hf_model

    hf = random_hf_model(hf_configs()["glm4_moe"])
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    n = hf.config.num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(32, 64)  # GLM-4.5's files hold one MTP layer here
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    d = json.loads((tmp_path / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(d))
    model = load_pretrained(tmp_path, dtype=torch.float32)
    assert model.cfg.mtp_depth == 0 and model.mtp is None
    ids = torch.arange(9)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
