"""The family registry: every family's presets are collected under distinct names and survive the
trip through their own config.json; MoE families are exactly those whose models have routed experts."""

import pytest

from tessera.config import ConfigError, ModelConfig
from tessera.config.families import REGISTRY
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.config.presets import PRESETS


def test_every_preset_of_every_family_is_collected_once():
    names = [name for family in REGISTRY.values() for name in family.presets]
    assert len(names) == len(set(names)) == len(PRESETS)
    for family in REGISTRY.values():
        for name in family.presets:
            assert PRESETS[name].family == family.name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_round_trips_through_its_families_config_json(name):
    cfg = PRESETS[name]
    back = config_from_hf(config_to_hf(cfg))
    kept = ("family", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "rope_theta",
            "rope_scaling", "max_seq_len", "qkv_bias", "out_bias", "qk_norm", "mla")
    assert {k: getattr(back, k) for k in kept} == {k: getattr(cfg, k) for k in kept}
    assert (back.moe is None) == (cfg.moe is None) == (not REGISTRY[cfg.family].moe)
    if cfg.moe is None:
        assert back.ffn_dim == cfg.ffn_dim
    else:  # Mixtral's intermediate_size is its experts' (it has no dense layers)
        assert (back.moe.num_experts, back.moe.top_k, back.moe.ffn_dim, back.moe_layers) == (
            cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.ffn_dim, cfg.moe_layers)


def test_model_config_refuses_a_family_the_registry_does_not_know():
    with pytest.raises(ConfigError, match=r"model.family='gpt2' is invalid: one of llama, mistral, .*deepseek_v3"):
        ModelConfig(family="gpt2")
