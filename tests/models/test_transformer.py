"""The decoder itself: shapes, names, initialisation by name, MoE outputs, config validation."""

import dataclasses

import pytest
import torch

from tessera.config import ConfigError, ModelConfig, MoEConfig, get_preset, preset_names
from tessera.models import Transformer
from tessera.models.counting import count_params

SHAPES = {"olmo2-like": dict(family="olmo2", block_norms="post", qk_norm=True, qk_norm_all_heads=True),
          "gemma3-like-norms": dict(block_norms="pre_post", qk_norm=True)}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-deepseek", "tiny-qwen3-next", "tiny-qwen3.5",
                                  "tiny-kimi-linear", *SHAPES])
def test_forward_shapes_and_param_count(name):
    cfg = get_preset("tiny-llama", **SHAPES[name]) if name in SHAPES else get_preset(name)
    model = Transformer(cfg)
    out = model(torch.randint(0, cfg.vocab_size, (2, 9)))
    assert out.logits.shape == (2, 9, cfg.vocab_size)
    assert out.aux_loss.shape == () and out.aux_loss.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)
    assert list(model.layers.keys()) == [str(i) for i in range(cfg.n_layers)]
    assert sorted(out.expert_counts) == cfg.moe_layers
    for counts in out.expert_counts.values():
        assert counts.sum().item() == 2 * 9 * cfg.moe.top_k


def test_published_parameter_counts():
    # Mixtral 8x7B: 46.7B total, 12.9B active; DeepSeek-V3: 671B total, 37B active (arXiv 2412.19437);
    # Qwen3-30B-A3B: 30.5B / 3.3B; LLaMA-3-8B: 8.0B; SmolLM3-3B: 3.08B (tied embeddings).
    assert round(count_params(get_preset("mixtral-8x7b")) / 1e9, 1) == 46.7
    assert round(count_params(get_preset("mixtral-8x7b"), active=True) / 1e9, 1) == 12.9
    assert round(count_params(get_preset("deepseek-v3")) / 1e9) == 671
    assert round(count_params(get_preset("deepseek-v3"), active=True) / 1e9) in (37, 38)
    assert round(count_params(get_preset("qwen3-30b-a3b")) / 1e9, 1) == 30.5
    assert round(count_params(get_preset("llama3-8b")) / 1e9, 1) == 8.0
    assert round(count_params(get_preset("smollm3-3b")) / 1e9, 2) == 3.08
    assert round(count_params(get_preset("olmo2-7b")) / 1e9, 1) == 7.3  # OLMo 2 7B: 7.30B, 13B: 13.7B
    assert round(count_params(get_preset("olmo2-13b")) / 1e9, 1) == 13.7
    assert round(count_params(get_preset("olmo3-7b")) / 1e9, 1) == 7.3  # OLMo 3 7B: 7.30B, 32B: 32.2B
    assert round(count_params(get_preset("olmo3-32b")) / 1e9, 1) == 32.2
    assert round(count_params(get_preset("seed-oss-36b")) / 1e9, 1) == 36.2  # Seed-OSS-36B: 36.15B
    assert round(count_params(get_preset("exaone4-1.2b")) / 1e9, 2) == 1.28  # EXAONE 4.0: 1.28B, 32.0B
    assert round(count_params(get_preset("exaone4-32b")) / 1e9, 1) == 32.0
    # Llama 4 (text): Scout 17B active of 108B (109B with its vision encoder), Maverick 17B of 400B
    assert round(count_params(get_preset("llama4-scout-17b-16e")) / 1e9) == 108
    assert round(count_params(get_preset("llama4-maverick-17b-128e")) / 1e9) == 401
    for name in ("llama4-scout-17b-16e", "llama4-maverick-17b-128e"):
        assert round(count_params(get_preset(name), active=True) / 1e9) == 17
    assert round(count_params(get_preset("qwen3-next-80b-a3b")) / 1e9, 1) == 79.7  # 80B total, 3B active
    assert round(count_params(get_preset("qwen3-next-80b-a3b"), active=True) / 1e9, 1) == 3.9
    assert round(count_params(get_preset("kimi-linear-48b-a3b")) / 1e9, 1) == 49.1  # Kimi Linear: 48B, 3B active
    assert round(count_params(get_preset("kimi-linear-48b-a3b"), active=True) / 1e9, 1) == 3.5  # 2.7 + embeddings
    assert count_params(get_preset("phi3-mini-4k")) == 3_821_079_552  # Phi-3-mini: 3.82B; Phi-4-mini: 3.84B
    assert round(count_params(get_preset("phi4-mini")) / 1e9, 2) == 3.84
    assert count_params(get_preset("gemma3-1b")) == 999_885_952  # Gemma 3 1B; the text models of 4B, 12B, 27B
    assert [round(count_params(get_preset(f"gemma3-{n}")) / 1e9, 1) for n in ("4b", "12b", "27b")] == [3.9, 11.8, 27.0]


def test_every_preset_validates():
    for name in preset_names():
        assert count_params(get_preset(name)) > 0


def test_initialisation_depends_only_on_seed_and_name():
    cfg = get_preset("tiny-moe")
    a, b = Transformer(cfg), Transformer(dataclasses.replace(cfg, n_layers=1))
    a.init_weights(7)
    b.init_weights(7)
    sb = b.state_dict()
    for k, v in a.state_dict().items():
        if k in sb:
            assert torch.equal(v, sb[k]), k
    c = Transformer(cfg)
    c.init_weights(8)
    assert not torch.equal(c.layers["0"].attention.wq.weight, a.layers["0"].attention.wq.weight)


def test_moe_aux_losses_are_reported_per_layer_and_summed():
    cfg = get_preset("tiny-moe")
    model = Transformer(cfg)
    out = model(torch.randint(0, cfg.vocab_size, (2, 8)))
    assert set(out.aux_losses) == {f"layer{i}/{n}" for i in range(2) for n in ("load_balancing", "z_loss")}
    torch.testing.assert_close(out.aux_loss, sum(out.aux_losses.values()))
    out.aux_loss.backward()
    assert model.layers["0"].moe.router.weight.grad.abs().sum() > 0


def test_sinkhorn_routing_trains_and_evaluates():
    cfg = get_preset("tiny-moe")
    cfg.moe = dataclasses.replace(cfg.moe, sinkhorn=True)
    model = Transformer(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(ids)
    (out.logits.sum() + out.aux_loss).backward()
    model.eval()
    assert model(ids).logits.shape == (2, 16, cfg.vocab_size)


def test_expert_bias_update_through_the_model():
    cfg = get_preset("tiny-deepseek")
    model = Transformer(cfg)
    out = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    model.update_expert_bias(out.expert_counts)
    bias = model.layers["1"].moe.router.expert_bias
    assert bias.abs().sum() > 0 and "layers.1.moe.router.expert_bias" in model.state_dict()


def test_bf16_forward():
    cfg = get_preset("tiny-moe")
    model = Transformer(cfg).to(torch.bfloat16)
    out = model(torch.randint(0, cfg.vocab_size, (1, 8)))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


@pytest.mark.parametrize("field,value,needle", [
    ("n_kv_heads", 3, "model.n_kv_heads"),
    ("family", "gpt2", "model.family"),
    ("dim", 0, "model.dim"),
    ("sliding_window", -1, "model.sliding_window"),
    ("nope_layers", [2], r"model.nope_layers=\[2\] is invalid: must be a list of distinct layer indices in 0..1"),
    ("nope_layers", [1, 1], "model.nope_layers"),
    ("window_layers", [0], r"model.window_layers=\[0\] is invalid: must be None \(the window on every layer\) or, "
                           "with a sliding_window"),
    ("local_rope_theta", 5e4, r"model.local_rope_theta=50000.0 is invalid: must be None or, with model.window_layers"),
    ("nope_attn_scale", -0.1, r"model.nope_attn_scale=-0.1 is invalid: must be a finite number >= 0"),
    ("attention_chunk_size", 0, r"model.attention_chunk_size=0 is invalid: must be None or an integer in 1.."),
    ("block_norms", "mid", r"model.block_norms='mid' is invalid: one of pre, post, pre_post"),
    ("qk_norm_all_heads", True, r"model.qk_norm_all_heads=True is invalid: needs model.qk_norm=true"),
])
def test_invalid_model_config_names_the_field(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        dataclasses.replace(get_preset("tiny-llama"), **{field: value})


@pytest.mark.parametrize("kw,needle", [
    ({"top_k": 9}, "moe.top_k"),
    ({"score_func": "relu"}, "moe.score_func"),
    ({"n_groups": 3}, "moe.n_groups"),
    ({"capacity_factor": 0.0}, "moe.capacity_factor"),
    ({"drop_policy": "random"}, "moe.drop_policy"),
    ({"gate_input": True}, r"model.moe.gate_input=True is invalid: needs top_k=1 \(Llama 4 scales each token by"),
])
def test_invalid_moe_config_names_the_field(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig(family="mixtral", vocab_size=16, dim=8, n_layers=1, n_heads=2, ffn_dim=8,
                    moe=MoEConfig(num_experts=8, **kw))


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="dimm"):
        ModelConfig.from_dict({"dimm": 3})
    with pytest.raises(ConfigError, match="unknown model name"):
        get_preset("llama-9000")


def test_router_stays_fp32_and_experts_run_bf16_under_autocast():
    cfg = get_preset("tiny-moe")
    model = Transformer(cfg)
    moe = model.layers["0"].moe
    seen = {}
    moe.experts.register_forward_hook(lambda m, i, o: seen.update(experts=o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        route = moe.router(torch.randn(6, cfg.dim), (1, 6))
        model(torch.randint(0, cfg.vocab_size, (1, 8)))
    assert route.weights_Tk.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in route.losses.values())
    assert seen["experts"] == torch.bfloat16


def test_preset_override_of_dim_rederives_head_dim():
    cfg = get_preset("tiny-llama", dim=128)
    assert cfg.head_dim == 128 // cfg.n_heads
    assert get_preset("qwen3-30b-a3b", dim=1024).head_dim == 128  # head_dim != dim // n_heads: explicit, kept


def test_family_and_moe_section_must_agree():
    with pytest.raises(ConfigError, match="model.family"):
        ModelConfig(family="llama", vocab_size=16, dim=8, n_layers=1, n_heads=2, ffn_dim=8,
                    moe=MoEConfig(num_experts=2, top_k=1))
    with pytest.raises(ConfigError, match="model.family"):
        ModelConfig(family="mixtral", vocab_size=16, dim=8, n_layers=1, n_heads=2, ffn_dim=8)


@pytest.mark.parametrize("scaling,needle", [
    ({"rope_type": "yarn"}, "rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_scaling.low_freq_factor"),
    ({"rope_type": "ntk"}, "rope_scaling.rope_type"),
])
def test_rope_scaling_needs_its_keys(scaling, needle):
    with pytest.raises(ConfigError, match=needle):
        get_preset("tiny-llama", rope_scaling=scaling)


def test_capacity_drops_tokens_in_training_only():
    cfg = get_preset("tiny-moe")
    cfg.moe = dataclasses.replace(cfg.moe, capacity_factor=0.25)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    dropless = Transformer(get_preset("tiny-moe")).eval()
    model.eval()
    torch.testing.assert_close(model(ids).logits, dropless(ids).logits)  # same init, no dropping at inference
    model.train()
    assert not torch.allclose(model(ids).logits, dropless(ids).logits)
