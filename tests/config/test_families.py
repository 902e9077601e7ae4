"""The family registry: every family's presets are collected under distinct names and survive the
trip through their own config.json; MoE families are exactly those whose models have routed experts (a
family whose experts are optional, Nemotron-H's, may have presets of both)."""

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
            "rope_scaling", "max_seq_len", "qkv_bias", "out_bias", "qk_norm", "mla", "nope_layers")
    assert {k: getattr(back, k) for k in kept} == {k: getattr(cfg, k) for k in kept}
    family = REGISTRY[cfg.family]
    assert (back.moe is None) == (cfg.moe is None)
    if not family.moe_optional:  # (Nemotron-H's presets may have routed experts or not: its MoE variants)
        assert (cfg.moe is None) == (not family.moe)
    if cfg.moe is None:
        assert back.ffn_dim == cfg.ffn_dim
    else:  # Mixtral's intermediate_size is its experts' (it has no dense layers)
        assert (back.moe.num_experts, back.moe.top_k, back.moe.ffn_dim, back.moe_layers) == (
            cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.ffn_dim, cfg.moe_layers)


def test_model_config_refuses_a_family_the_registry_does_not_know():
    with pytest.raises(ConfigError, match=r"model.family='gpt2' is invalid: one of llama, mistral, .*deepseek_v3"):
        ModelConfig(family="gpt2")


def test_a_sparse_step_of_zero_is_a_bad_file_not_a_division_by_zero(tmp_path):
    import json

    from tessera.config import CheckpointError
    from tessera.config.hf_config import read_hf_config

    d = config_to_hf(PRESETS["qwen2-moe-a2.7b"]) | {"decoder_sparse_step": 0}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"config.json': decoder_sparse_step=0 is invalid: must be >= 1"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_a_family_without_a_sliding_window_refuses_to_export_a_model_with_one(family):
    from dataclasses import replace

    from tessera.config import ModelError

    cfg = replace(next(PRESETS[n] for n in sorted(PRESETS) if PRESETS[n].family == family), sliding_window=4096)
    with pytest.raises(ModelError, match=rf"{family} has no sliding attention window \(model.sliding_window=4096\)"):
        config_to_hf(cfg)
    assert config_to_hf(replace(PRESETS["mistral-7b"], sliding_window=4096))["sliding_window"] == 4096


def test_layers_without_rope_export_only_as_smollm3():
    from dataclasses import replace

    from tessera.config import ModelError

    cfg = replace(PRESETS["llama3-8b"], nope_layers=[3, 7])
    with pytest.raises(ModelError, match=r"llama rotates every layer by RoPE \(model.nope_layers=\[3, 7\]\); export it "
                                         "as smollm3"):
        config_to_hf(cfg)
    d = config_to_hf(replace(cfg, family="smollm3"))
    assert d["no_rope_layers"][:8] == [1, 1, 1, 0, 1, 1, 1, 0] and sum(d["no_rope_layers"]) == 30
    assert config_from_hf(d).nope_layers == [3, 7]


@pytest.mark.parametrize("change, message", [
    ({"no_rope_layers": [1, 0]}, r"no_rope_layers=\[1, 0\] is invalid: must be a list of 0 \(NoPE\) or 1 \(RoPE\), one "
                                 r"per layer \(36\)"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0}, r"no_rope_layer_interval=0 is invalid: must be an integer"),
    ({"use_sliding_window": True, "sliding_window": 4096}, r"use_sliding_window=true is not supported for smollm3"),
])
def test_a_smollm3_file_tessera_cannot_reproduce_is_refused_naming_the_field(change, message, tmp_path):
    import json

    from tessera.config import CheckpointError, ModelError
    from tessera.config.hf_config import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(PRESETS["smollm3-3b"]) | change))
    with pytest.raises((CheckpointError, ModelError), match=message):
        read_hf_config(tmp_path)


def test_smollm3_without_a_list_puts_a_nope_layer_every_interval():
    d = config_to_hf(PRESETS["smollm3-3b"])
    del d["no_rope_layers"]
    assert config_from_hf(d | {"no_rope_layer_interval": 3}).nope_layers == list(range(2, 36, 3))


def test_norms_after_the_sublayers_and_an_all_heads_qk_norm_export_only_as_olmo():
    from dataclasses import replace

    from tessera.config import ModelError

    olmo2 = PRESETS["olmo2-7b"]
    with pytest.raises(ModelError, match=r"qwen3's QK norm is per head \(model.qk_norm_all_heads must be false\)"):
        config_to_hf(replace(olmo2, family="qwen3"))
    with pytest.raises(ModelError, match=r"qwen3's blocks have block_norms='pre' \(model.block_norms='post'\)"):
        config_to_hf(replace(olmo2, family="qwen3", qk_norm_all_heads=False))
    assert config_from_hf(config_to_hf(olmo2)) == olmo2


def test_tensor_parallelism_refuses_a_qk_norm_over_all_heads_naming_it():
    from tessera.config.layout_rules import LayoutSizes, layout_problems

    [problem] = layout_problems(PRESETS["olmo2-7b"], LayoutSizes(tp=2))
    assert problem.startswith("tp=2 cannot split a QK norm over all heads (model.qk_norm_all_heads=true, OLMo 2)")
    assert layout_problems(PRESETS["olmo2-7b"], LayoutSizes(pp=2, dp_shard=2)) == []


def test_windows_on_some_layers_and_their_own_rope_export_only_as_olmo3():
    from dataclasses import replace

    from tessera.config import ModelError

    olmo3 = PRESETS["olmo3-7b"]
    with pytest.raises(ModelError, match=r"olmo2 has no sliding attention window \(model.sliding_window=4096\); "
                                         r"export it as mistral \(a window on every layer\) or olmo3"):
        config_to_hf(replace(olmo3, family="olmo2"))
    with pytest.raises(ModelError, match=r"mistral has no per-layer windows or RoPE \(model.window_layers=\[0, 1, 2, "):
        config_to_hf(replace(olmo3, family="mistral", qk_norm=False, qk_norm_all_heads=False, block_norms="pre"))
    with pytest.raises(ModelError, match="olmo3 keeps some layers without a window: give model.window_layers"):
        config_to_hf(replace(olmo3, window_layers=None, local_rope_theta=None))
    with pytest.raises(ModelError, match="with model.rope_scaling set, model.local_rope_theta must say their base"):
        config_to_hf(replace(olmo3, local_rope_theta=None))
    d = config_to_hf(olmo3)
    assert d["layer_types"][:4] == ["sliding_attention"] * 3 + ["full_attention"]
    assert d["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert config_from_hf(d) == olmo3


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention"] * 3}, r"layer_types=.* is invalid: must list 'sliding_attention' or "
                                                 r"'full_attention' for each of the 32 layers"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"rope_parameters.sliding_attention=.* is not supported: Tessera's sliding layers rotate by unscaled RoPE"),
])
def test_an_olmo3_file_tessera_cannot_reproduce_is_refused_naming_the_field(change, message, tmp_path):
    import json

    from tessera.config import CheckpointError, ModelError
    from tessera.config.hf_config import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(PRESETS["olmo3-7b"]) | change))
    with pytest.raises((CheckpointError, ModelError), match=message):
        read_hf_config(tmp_path)


def test_olmo3_legacy_rope_keys_read_as_transformers_reads_them():
    """rope_scaling on the full layers only; rope_theta read for the full layers, the sliding ones
    at the class default (transformers 5's Olmo3Config)."""
    d = config_to_hf(PRESETS["olmo3-7b"])
    del d["rope_parameters"]
    cfg = config_from_hf(d | {"rope_theta": 20000.0})
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["rope_type"]) == (20000.0, 500000.0, "yarn")


def test_seed_oss_keeps_its_qkv_and_output_biases_apart():
    from dataclasses import replace

    cfg = PRESETS["seed-oss-36b"]
    d = config_to_hf(cfg)
    assert (d["attention_bias"], d["attention_out_bias"], d["residual_dropout"]) == (True, False, 0.0)
    assert (config_from_hf(d).qkv_bias, config_from_hf(d).out_bias) == (True, False)
    assert config_from_hf({k: v for k, v in d.items() if k != "attention_bias"}).qkv_bias  # the class's default
    both = replace(cfg, out_bias=True)
    assert config_from_hf(config_to_hf(both)).out_bias


def test_exaone4_global_layers_are_the_nope_ones():
    from dataclasses import replace

    from tessera.config import ModelError

    cfg = PRESETS["exaone4-32b"]
    d = config_to_hf(cfg)
    assert d["layer_types"][:4] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config_from_hf(d) == cfg
    legacy = config_from_hf({k: v for k, v in d.items() if k != "layer_types"} | {"sliding_window_pattern": "LLLG"})
    assert (legacy.window_layers, legacy.nope_layers) == (cfg.window_layers, cfg.nope_layers)
    small = config_to_hf(PRESETS["exaone4-1.2b"])
    assert small["sliding_window"] is None and set(small["layer_types"]) == {"full_attention"}
    assert config_from_hf(small).nope_layers == []
    with pytest.raises(ModelError, match=r"exaone4's layers without RoPE are exactly its full-attention ones when it "
                                         r"has a sliding window, and none without one \(model.nope_layers=\[3\]"):
        config_to_hf(replace(cfg, nope_layers=[3]))
    with pytest.raises(ModelError, match=r"exaone4 rotates every layer by one RoPE \(model.local_rope_theta=5000.0\)"):
        config_to_hf(replace(cfg, local_rope_theta=5000.0))


def test_llama4_text_maps_its_layers_both_ways_and_refuses_what_it_cannot_reproduce():
    from dataclasses import replace

    from tessera.config import ModelError

    scout, maverick = PRESETS["llama4-scout-17b-16e"], PRESETS["llama4-maverick-17b-128e"]
    d = config_to_hf(maverick)
    assert d["no_rope_layers"][:4] == [1, 1, 1, 0] and d["layer_types"][:4] == ["chunked_attention"] * 3 + [
        "full_attention"]
    assert d["moe_layers"] == list(range(1, 48, 2)) and (d["intermediate_size"], d["intermediate_size_mlp"]) == (
        8192, 16384)
    assert config_from_hf(d) == maverick and config_from_hf(config_to_hf(scout)) == scout
    legacy = {k: v for k, v in d.items() if k not in ("moe_layers", "layer_types")} | {"interleave_moe_layer_step": 2}
    assert config_from_hf(legacy).moe_layers == maverick.moe_layers
    with pytest.raises(ModelError, match=r"layer_types=.* is not supported: Tessera's Llama 4 attends in chunks on "
                                         r"exactly the layers with RoPE"):
        config_from_hf(d | {"layer_types": ["full_attention"] * 48})
    with pytest.raises(ModelError, match=r"llama4_text rotates adjacent pairs \(model.rope_interleave must be true\)"):
        config_to_hf(replace(maverick, rope_interleave=False))
    from tessera.checkpoint.hf.names import check_exportable

    with pytest.raises(ModelError, match=r"model.moe.top_k=2 cannot be exported as llama4_text"):
        check_exportable(replace(maverick, moe=replace(maverick.moe, top_k=2, gate_input=False)))
    with pytest.raises(ModelError, match=r"llama has no chunked attention \(model.attention_chunk_size=8192\)"):
        config_to_hf(replace(PRESETS["llama3-8b"], attention_chunk_size=8192))
