"""Qwen3.5 MoE, text (`qwen3_5_moe_text`), beyond the parity every family has (tests/models/test_hf_parity.py,
tests/cli/test_convert_families.py, which read transformers' `save_pretrained` layout: one tensor per
expert): a directory in the published layout (experts packed as `experts.gate_up_proj` [E, 2 * ffn, dim]
and `experts.down_proj`) gives transformers' logits over several DeltaNet chunks, Tessera's own export
writes that packed layout and transformers reads it back, greedy generation through the eager reference
and the serving engine gives transformers' tokens, a saved model loads back with the same logits and
config, the config maps both ways, and the presets have the published sizes (its layouts:
tests/parallel/test_hybrid_layouts.py)."""

import json

import pytest
import torch

from tessera.checkpoint.hf.names import check_exportable
from tessera.config import ModelError, get_preset
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.hf import load_pretrained, save_pretrained
from tessera.models.counting import count_params
from tests.models.hf_families import (
    check_greedy_eager_and_served,
    check_save_load_round_trip,
    hf_configs,
    random_hf_model,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' model and Tessera's, read from the published (packed) layout: the model's own
    state dict, which holds the experts packed, written with its config.json."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("qwen3_5_moe") / "hf"
    hf = random_hf_model(hf_configs()["qwen3_5_moe_text"], seed=3, std=0.2)
    hf.save_pretrained(path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (path / "model.safetensors").unlink()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return hf, load_pretrained(path, dtype=torch.float32), path


def test_packed_experts_read_as_their_halves_over_several_chunks(pair):
    hf, model, _ = pair
    assert model.cfg.moe.num_experts == 6 and model.cfg.linear_attention.projections == "split"
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj
    experts = model.layers["1"].moe.experts
    torch.testing.assert_close(experts.w1.detach(), gate_up[:, :16].detach(), rtol=0, atol=0)
    torch.testing.assert_close(experts.w3.detach(), gate_up[:, 16:].detach(), rtol=0, atol=0)
    ids = torch.randint(0, hf.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        # 150 tokens over three chunks of the delta rule: 3 of 14,400 logits differ by up to 2.1e-4 (position 122)
        # since the chunked form's summation order changed (tiles of 32). It is fp32 rounding on both sides: against
        # the model in float64, Tessera's fp32 logits are within 2.7e-4 and transformers' within 3.2e-4
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=3e-4, rtol=1e-4)


def test_export_writes_the_packed_layout_that_transformers_reads(pair, tmp_path):
    from safetensors import safe_open

    hf, model, _ = pair
    save_pretrained(model, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert list(f.get_slice("model.layers.2.mlp.experts.gate_up_proj").get_shape()) == [6, 32, 32]
    assert not any(".experts.0." in k for k in keys)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in config
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_greedy_generation_equals_transformers_eager_and_served(pair):
    check_greedy_eager_and_served(*pair)


def test_save_and_load_back_keeps_logits_and_config(pair, tmp_path):
    check_save_load_round_trip(pair[1], tmp_path / "out")


def test_config_maps_both_ways_and_what_the_class_lacks_is_refused():
    cfg = get_preset("tiny-qwen3.5-moe")
    d = config_to_hf(cfg)
    assert d["model_type"] == "qwen3_5_moe_text" and d["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert d["num_experts"] == 4 and d["shared_expert_intermediate_size"] == 64
    assert config_from_hf(d) == cfg
    grouped = get_preset("tiny-qwen3.5-moe", linear_attention={**vars(cfg.linear_attention), "projections": "grouped"})
    with pytest.raises(ModelError, match=r"projections=grouped\); export it as qwen3_next"):
        config_to_hf(grouped)
    with pytest.raises(ModelError, match=r"model.moe.norm_topk_prob=False cannot be exported as qwen3_5_moe_text"):
        check_exportable(get_preset("tiny-qwen3.5-moe", moe={**vars(cfg.moe), "norm_topk_prob": False}))
    with pytest.raises(ModelError, match=r"model.moe.shared_ffn_dim=0 cannot be exported as qwen3_5_moe_text"):
        check_exportable(get_preset("tiny-qwen3.5-moe", moe={**vars(cfg.moe), "shared_ffn_dim": 0}))
    with pytest.raises(ModelError, match=r"mlp_only_layers=\[1\] is not supported for qwen3_5_moe_text"):
        config_from_hf(d | {"mlp_only_layers": [1]})


def test_presets_have_the_published_sizes():
    """Qwen3.5-35B-A3B's text model: 34.7B of its 35B (the rest is the vision tower), 3.45B active;
    Qwen3.5-397B-A17B's: 396.3B, 17.3B active."""
    small, large = get_preset("qwen3.5-35b-a3b"), get_preset("qwen3.5-397b-a17b")
    assert round(count_params(small) / 1e9, 1) == 34.7 and round(count_params(small, active=True) / 1e9, 2) == 3.45
    assert round(count_params(large) / 1e9, 1) == 396.3 and round(count_params(large, active=True) / 1e9, 1) == 17.3
    assert config_from_hf(config_to_hf(small)) == small
