"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen2-MoE's experts without the shared one, under Qwen3's
attention (QK norm, one attention_bias); top-k weights renormalised unless config.json says not."""

from __future__ import annotations

from tessera.config.families.qwen2_moe import QwenMoE

FAMILY = QwenMoE(
    name="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True, has_shared_expert=False,
    norm_topk_default=True,
    presets={"qwen3-30b-a3b": dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                                   ffn_dim=6144, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, qk_norm=True,
                                   moe=dict(num_experts=128, top_k=8, ffn_dim=768, aux_loss_coef=0.001))},
)
