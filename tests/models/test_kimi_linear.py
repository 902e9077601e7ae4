"""Kimi Linear (`kimi_linear`), beyond the parity every family has (tests/models/test_hf_parity.py,
tests/cli/test_convert_families.py): a prompt of several delta-attention chunks gives transformers'
logits, greedy generation through the eager reference and through the serving engine (delta states in
recurrent-state slots, MLA keys and values in paged blocks, chunked prefill, requests batched
together) gives transformers' tokens, a saved model loads back with the same logits and config,
Moonshot's config.json (linear_attn_config, its expert field names) reads as the preset's shapes, and
what its class cannot express is refused on export."""

import pytest
import torch

from tessera.checkpoint.hf.names import check_exportable
from tessera.config import ModelError, get_preset
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.hf import load_pretrained
from tests.models.hf_families import (
    check_greedy_eager_and_served,
    check_save_load_round_trip,
    hf_configs,
    random_hf_model,
)

transformers = pytest.importorskip("transformers")

# Kimi-Linear-48B-A3B-Instruct's config.json, as Moonshot publishes it (the fields that shape the model)
MOONSHOT = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 163840,
    "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
    "intermediate_size": 9216, "head_dim": 72, "model_max_length": 1048576, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
                           "short_conv_kernel_size": 4},
    "num_experts": 256, "moe_intermediate_size": 1024, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts_per_token": 8, "num_shared_experts": 1, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear") / "hf"
    hf = random_hf_model(hf_configs()["kimi_linear"], seed=3, std=0.2)
    hf.save_pretrained(path)
    return hf, load_pretrained(path, dtype=torch.float32), path


def test_prompt_of_several_chunks_equals_transformers(pair):
    hf, model, _ = pair
    la = model.cfg.linear_attention
    assert la.layers == [0, 2, 3] and la.kind == "kda" and model.cfg.nope_layers == [1, 4]
    assert model.cfg.moe.first_k_dense == 1 and model.cfg.mla is not None
    ids = torch.randint(0, hf.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_greedy_generation_equals_transformers_eager_and_served(pair):
    check_greedy_eager_and_served(*pair)


def test_save_and_load_back_keeps_logits_and_config(pair, tmp_path):
    _, model, _ = pair
    check_save_load_round_trip(model, tmp_path / "out")


def test_moonshot_config_reads_as_the_preset_and_maps_both_ways():
    cfg = get_preset("kimi-linear-48b-a3b")
    assert config_from_hf(MOONSHOT) == cfg
    d = config_to_hf(cfg)
    assert d["linear_attn_config"] == MOONSHOT["linear_attn_config"]
    assert {k: d[k] for k in ("num_experts", "num_experts_per_token", "num_shared_experts", "num_expert_group",
                              "moe_renormalize", "model_max_length")} == {
        k: MOONSHOT[k] for k in ("num_experts", "num_experts_per_token", "num_shared_experts", "num_expert_group",
                                 "moe_renormalize", "model_max_length")}
    assert config_from_hf(d) == cfg
    tiny = get_preset("tiny-kimi-linear")
    assert config_from_hf(config_to_hf(tiny)) == tiny


def test_what_the_class_cannot_express_is_refused():
    with pytest.raises(ModelError, match="moe_router_activation_func='softmax' is not supported"):
        config_from_hf({**MOONSHOT, "moe_router_activation_func": "softmax"})
    with pytest.raises(ModelError, match="mla_use_nope=false is not supported"):
        config_from_hf({**MOONSHOT, "mla_use_nope": False})
    with pytest.raises(ModelError, match=r"kda_layers=\[1\] and full_attn_layers=\[4\] are invalid"):
        config_from_hf({**MOONSHOT, "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [4]}})
    rotated = get_preset("tiny-kimi-linear", nope_layers=[])
    with pytest.raises(ModelError, match=r"every attention layer in model.nope_layers \(they are \[3\]"):
        check_exportable(rotated)
