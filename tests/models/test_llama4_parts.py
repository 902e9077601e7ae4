"""Llama 4's text decoder built from Tessera's switches equals transformers' Llama4ForCausalLM (fp32,
1e-4) on a small random config with awkward shapes: chunked local attention on the layers with RoPE
(`model.attention_chunk_size`), the layers without RoPE under attention temperature tuning
(`model.nope_attn_scale`), the weightless QK norm (`model.qk_l2_norm`), llama3 RoPE scaling, and
MoE layers interleaved with dense ones whose one sigmoid gate scales the token going into its
expert beside a shared expert (`model.moe.gate_input`). The weights are copied by hand here: the
family's config.json and tensor mapping (fused experts, interleaved rotary pairs) are not built yet."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models import Transformer
from tests.models.hf_families import random_hf_model

transformers = pytest.importorskip("transformers")
LAYERS, CHUNK = 4, 5


def hf_config():
    return transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-6,
        num_local_experts=3, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1],
        attention_chunk_size=CHUNK, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
        pad_token_id=None, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 20000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def tessera_config() -> ModelConfig:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    return ModelConfig(family="qwen2_moe", vocab_size=96, dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2,
                       head_dim=12, ffn_dim=40, norm_eps=1e-6, rope_theta=20000.0, rope_scaling=rope,
                       max_seq_len=128, nope_layers=[2], attention_chunk_size=CHUNK, qk_l2_norm=True,
                       nope_attn_scale=0.5, nope_floor_scale=4,
                       moe=dict(num_experts=3, top_k=1, ffn_dim=24, dense_layers=[0, 2], score_func="sigmoid",
                                norm_topk_prob=False, shared_ffn_dim=24, gate_input=True))


def halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection from rotary pairs side by side (x0, x1), (x2, x3) ... (Llama 4's
    complex rotation) to Tessera's halves (x0, x2, ...), (x1, x3, ...): the same scores."""
    rows = w.unflatten(0, (-1, head_dim // 2, 2))
    return rows.transpose(1, 2).flatten(0, 2)


def tessera_state(hf, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd, out = hf.state_dict(), {"tok_embeddings.weight": hf.state_dict()["model.embed_tokens.weight"]}
    out["norm.weight"], out["output.weight"] = sd["model.norm.weight"], sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "attention_norm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "ffn_norm.weight"] = sd[src + "post_attention_layernorm.weight"]
        for t, h in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            w = sd[f"{src}self_attn.{h}.weight"]
            out[f"{dst}attention.{t}.weight"] = halves(w, cfg.head_dim) if t in ("wq", "wk") else w
        ff = src + "feed_forward."
        if not cfg.is_moe_layer(i):
            for t, h in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                out[f"{dst}feed_forward.{t}.weight"] = sd[f"{ff}{h}.weight"]
            continue
        gate_up, F = sd[ff + "experts.gate_up_proj"], cfg.moe.ffn_dim  # [E, D, 2F]
        out[dst + "moe.router.weight"] = sd[ff + "router.weight"]
        out[dst + "moe.experts.w1"] = gate_up[..., :F].transpose(1, 2).contiguous()
        out[dst + "moe.experts.w3"] = gate_up[..., F:].transpose(1, 2).contiguous()
        out[dst + "moe.experts.w2"] = sd[ff + "experts.down_proj"].transpose(1, 2).contiguous()
        for t, h in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            out[f"{dst}moe.shared_experts.{t}.weight"] = sd[f"{ff}shared_expert.{h}.weight"]
    return out


def test_the_decoder_equals_transformers_llama4():
    hf = random_hf_model(hf_config(), std=0.2)
    cfg = tessera_config()
    assert [i for i in range(LAYERS) if cfg.is_moe_layer(i)] == hf.config.moe_layers == [1, 3]
    model = Transformer(cfg, init_seed=None)
    model.load_state_dict(tessera_state(hf, cfg), strict=True)
    model.eval()
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(1))  # 5 chunks, temperature steps
    with torch.no_grad():
        want, got = hf(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # each part bites: without it the logits differ
    moe = cfg.to_dict()["moe"]
    for change in (dict(attention_chunk_size=None), dict(qk_l2_norm=False), dict(nope_attn_scale=0.0),
                   dict(moe={**moe, "gate_input": False})):
        other = Transformer(ModelConfig(**{**cfg.to_dict(), **change}), init_seed=None)
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert not torch.allclose(other(ids).logits, want, atol=1e-3), change


def test_the_engine_decodes_as_transformers_generates():
    """The paged engine (chunked prefill, blocks of 4 across chunks of 5): greedy tokens equal to
    transformers' `generate`, whose cache holds every layer's keys."""
    from tessera.infer import LLM, SamplingParams
    from tests.infer.tiny_models import hf_greedy

    hf = random_hf_model(hf_config(), std=0.25)
    cfg = tessera_config()
    model = Transformer(cfg, init_seed=None)
    model.load_state_dict(tessera_state(hf, cfg), strict=True)
    prompts = [[0, 5, 17, 33, 2, 9, 40, 41, 42, 43, 44], [0, 70], [0] + list(range(3, 20))]
    llm = LLM(model.eval(), block_size=4, max_num_batched_tokens=6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
