"""Qwen3 (Qwen3ForCausalLM): LLaMA's decoder with RMSNorm on q and k before RoPE."""

from __future__ import annotations

from tessera.config.families.base import Family

FAMILY = Family(name="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True, presets={
    "qwen3-8b": dict(vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                     ffn_dim=12288, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, qk_norm=True),
})
