"""Phi-3 / Phi-4-mini and Gemma 3's configs: their presets survive config.json whole; what their
HuggingFace classes cannot express is refused naming the field, both ways; the parts only they have
(LongRoPE, partial rotary, GeGLU, (1 + weight) norms, scaled embeddings, query_pre_attn_scalar) are
refused by every other family's export; and the model fields that switch them are checked."""

import dataclasses
import json

import pytest

from tessera.config import CheckpointError, ConfigError, ModelError
from tessera.config.hf_config import config_from_hf, config_to_hf, read_hf_config
from tessera.config.presets import PRESETS, get_preset

NEW = ("phi3-mini-4k", "phi3-mini-128k", "phi4-mini", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b")


@pytest.mark.parametrize("name", NEW)
def test_the_presets_survive_config_json_whole(name):
    assert config_from_hf(config_to_hf(PRESETS[name])) == PRESETS[name]


def test_gemma3_file_reads_as_transformers_reads_it():
    """Legacy keys: rope_theta and rope_scaling for the global layers, rope_local_base_freq for the
    sliding ones; five sliding layers to one global by default (sliding_window_pattern)."""
    d = {"model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 7,
         "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 48, "head_dim": 16,
         "rope_theta": 20000.0, "rope_local_base_freq": 5000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "sliding_window": 4}
    cfg = config_from_hf(d)
    assert cfg.window_layers == [0, 1, 2, 3, 4, 6]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (20000.0, 5000.0,
                                                                        {"rope_type": "linear", "factor": 8.0})
    assert (cfg.query_pre_attn_scalar, cfg.activation, cfg.norm_unit_offset, cfg.embed_scale) == (256.0, "gelu_tanh",
                                                                                                 True, True)
    assert cfg.tie_embeddings


def test_phi3_legacy_su_scaling_reads_as_longrope_with_its_top_level_original_length():
    d = config_to_hf(PRESETS["phi3-mini-128k"])
    d["rope_scaling"] = {**d["rope_scaling"], "type": "su"}
    del d["rope_scaling"]["rope_type"], d["rope_scaling"]["factor"]
    cfg = config_from_hf(d)
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.rope_scaling["factor"] == 131072 / 4096  # transformers' default: max / original


@pytest.mark.parametrize("family, change, message", [
    ("gemma3_text", {"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0 is not supported for gemma3"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50.0 is not supported"),
    ("gemma3_text", {"hidden_activation": "gelu"}, r"hidden_activation='gelu' is not supported; Gemma 3's MLP is"),
    ("gemma3_text", {"layer_types": ["full_attention"]}, r"layer_types=.* is invalid: must list 'sliding_attention'"),
    ("phi3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"phi3 rope_scaling=.* is not supported: "
                                                                       r"Phi3ForCausalLM takes rope_type longrope"),
    ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     r"model.rope_scaling.short_factor=\[1.0\] is invalid: rope_type longrope needs 48 finite numbers > 0"),
])
def test_a_file_tessera_cannot_reproduce_is_refused_naming_the_field(family, change, message, tmp_path):
    preset = {"gemma3_text": "gemma3-1b", "phi3": "phi3-mini-4k"}[family]
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(PRESETS[preset]) | change))
    with pytest.raises((CheckpointError, ConfigError, ModelError), match=message):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"activation": "gelu_tanh"}, r"llama has no such part \(model.activation='gelu_tanh', its class needs 'silu'\); "
                                  r"export it as gemma3_text"),
    ({"norm_unit_offset": True}, r"model.norm_unit_offset=True.*export it as gemma3_text"),
    ({"embed_scale": True}, r"model.embed_scale=True.*export it as gemma3_text"),
    ({"query_pre_attn_scalar": 20.0}, r"model.query_pre_attn_scalar=20.0.*export it as gemma3_text"),
    ({"partial_rotary_factor": 0.5}, r"model.partial_rotary_factor=0.5.*export it as phi3"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 8,
                       "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     r"llama's class has no LongRoPE \(model.rope_scaling.rope_type=longrope\); export it as phi3"),
])
def test_other_families_refuse_to_export_the_new_parts(change, message):
    with pytest.raises(ModelError, match=message):
        config_to_hf(dataclasses.replace(get_preset("tiny-llama"), **change))


def test_gemma3_export_refuses_a_model_without_its_parts():
    with pytest.raises(ModelError, match=r"gemma3_text's class has GeGLU, \(1 \+ weight\) norms"):
        config_to_hf(dataclasses.replace(PRESETS["gemma3-1b"], activation="silu"))
    with pytest.raises(ModelError, match="with model.rope_scaling set, model.local_rope_theta must say their base"):
        config_to_hf(dataclasses.replace(PRESETS["gemma3-4b"], local_rope_theta=None))


@pytest.mark.parametrize("field, value, needle", [
    ("activation", "relu", r"model.activation='relu' is invalid: one of silu, gelu_tanh"),
    ("query_pre_attn_scalar", 0.0, r"model.query_pre_attn_scalar=0.0 is invalid: must be None or a finite number > 0"),
    ("partial_rotary_factor", 0.1, r"model.partial_rotary_factor=0.1 is invalid: must be in \(0, 1\] rotating an even "
                                   r"number of the head_dim=16 dimensions"),
    ("partial_rotary_factor", 0.0, r"model.partial_rotary_factor=0.0 is invalid"),
])
def test_invalid_part_fields_name_the_field(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        dataclasses.replace(get_preset("tiny-llama"), **{field: value})


def test_gelu_experts_are_refused():
    with pytest.raises(ConfigError, match=r"model.activation='gelu_tanh' is invalid: .*routed experts are SwiGLU"):
        dataclasses.replace(get_preset("tiny-moe"), activation="gelu_tanh")
