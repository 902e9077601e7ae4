"""OLMo 2 (Olmo2ForCausalLM): LLaMA's decoder with its RMSNorms after attention and after the MLP
(on their outputs, before the residual add; none before them) and one QK RMSNorm over all heads'
queries and one over all keys, before RoPE."""

from __future__ import annotations

from tessera.config.families.base import Family

FAMILY = Family(name="olmo2", architecture="Olmo2ForCausalLM", qk_norm=True, qk_norm_all_heads=True,
                block_norms="post", presets={
    # allenai/OLMo-2-1124-7B and OLMo-2-1124-13B
    "olmo2-7b": dict(vocab_size=100352, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, norm_eps=1e-6,
                     rope_theta=500000.0, max_seq_len=4096, qk_norm=True, qk_norm_all_heads=True, block_norms="post"),
    "olmo2-13b": dict(vocab_size=100352, dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, norm_eps=1e-6,
                      rope_theta=500000.0, max_seq_len=4096, qk_norm=True, qk_norm_all_heads=True,
                      block_norms="post"),
})
