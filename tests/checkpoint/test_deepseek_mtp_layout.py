"""DeepSeek-V3's HuggingFace layout of its multi-token-prediction layer: `model.layers.{L}` after
the last decoder layer (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`,
`embed_tokens` and the usual block weights) and `num_nextn_predict_layers` in config.json, imported
into model.mtp_depth and exported back bit for bit. transformers drops those layers when it loads
the directory, and its logits are Tessera's main model's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tessera.config.errors import ModelError
from tessera.config.hf_config import config_from_hf
from tessera.hf import load_pretrained, save_pretrained
from tessera.models.transformer import Transformer
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")


def _deepseek_with_mtp(depth: int = 1) -> Transformer:
    cfg = config_from_hf(hf_configs()["deepseek_v3"].to_dict())
    cfg.mtp_depth = depth
    cfg.init_std = 0.08
    cfg.validate()
    return Transformer(cfg, init_seed=7).eval()


@pytest.mark.parametrize("depth", [1, 2])
def test_export_and_import_of_the_mtp_layers_round_trip_bit_for_bit(depth, tmp_path):
    model = _deepseek_with_mtp(depth)
    L = model.cfg.n_layers
    save_pretrained(model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == depth and config["num_hidden_layers"] == L
    stored = load_file(tmp_path / "a" / "model.safetensors")
    for k in range(depth):
        layer = f"model.layers.{L + k}"
        for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
                     "input_layernorm", "self_attn.kv_a_proj_with_mqa", "mlp.gate", "mlp.experts.0.down_proj"):
            assert f"{layer}.{name}.weight" in stored, name
        assert torch.equal(stored[f"{layer}.shared_head.head.weight"], stored["lm_head.weight"])
        assert torch.equal(stored[f"{layer}.embed_tokens.weight"], stored["model.embed_tokens.weight"])
        assert torch.equal(stored[f"{layer}.eh_proj.weight"], model.mtp[str(k + 1)].eh_proj.weight)

    back = load_pretrained(tmp_path / "a")
    assert back.cfg.mtp_depth == depth
    want = model.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    save_pretrained(back, tmp_path / "b")
    again = load_file(tmp_path / "b" / "model.safetensors")
    assert set(again) == set(stored) and all(torch.equal(again[k], stored[k]) for k in stored)


def test_transformers_loads_the_directory_without_the_mtp_layer_and_agrees(tmp_path):
    model = _deepseek_with_mtp(1)
    save_pretrained(model, tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert len(hf.model.layers) == model.cfg.n_layers  # the MTP layer is not one of its decoder layers
    ids = torch.randint(0, model.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_directory_transformers_wrote_has_no_mtp_layer_to_import(tmp_path):
    """transformers writes num_nextn_predict_layers (default 1) but no MTP weights: depth 0."""
    hf = random_hf_model(hf_configs()["deepseek_v3"])
    assert hf.config.num_nextn_predict_layers == 1
    hf.save_pretrained(tmp_path / "hf")
    assert load_pretrained(tmp_path / "hf").cfg.mtp_depth == 0


def test_families_without_an_mtp_layout_refuse_to_export_it(tmp_path):
    cfg = config_from_hf(hf_configs()["qwen3"].to_dict())
    cfg.mtp_depth = 1
    with pytest.raises(ModelError, match=r"qwen3 has no HuggingFace layout for multi-token-prediction"):
        save_pretrained(Transformer(cfg), tmp_path / "q")
    assert not (tmp_path / "q").exists()
