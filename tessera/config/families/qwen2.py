"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): LLaMA's decoder with biases on q, k and v, none on o."""

from __future__ import annotations

from tessera.config.families.base import Family

FAMILY = Family(name="qwen2", architecture="Qwen2ForCausalLM", qkv_bias_only=True, presets={
    "qwen2-7b": dict(vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                     norm_eps=1e-6, rope_theta=1e6, max_seq_len=32768, qkv_bias=True),
})
