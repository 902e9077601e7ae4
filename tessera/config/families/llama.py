"""LLaMA 2 / 3 / 3.1 (LlamaForCausalLM): the shared decoder as it is; attention_bias puts a bias on
q, k, v and o alike."""

from __future__ import annotations

from tessera.config.families.base import Family

_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

FAMILY = Family(name="llama", architecture="LlamaForCausalLM", presets={
    "llama2-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, norm_eps=1e-5,
                      max_seq_len=4096),
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      rope_theta=500000.0, max_seq_len=8192),
    "llama3.1-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                        rope_theta=500000.0, max_seq_len=131072, rope_scaling=_LLAMA3_SCALING),
    "llama3-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       rope_theta=500000.0, max_seq_len=8192),
    # tests and the CPU demo
    "tiny-llama": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256),
})
