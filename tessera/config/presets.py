"""Named model configurations, so that nobody writes a model's shape by hand.

Real sizes follow the published HuggingFace `config.json` of each model; `tiny-*` ones are for
tests and CPU demos. `get_preset("mixtral-8x7b", n_layers=2)` returns a copy with overrides.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from tessera.config.errors import ConfigError
from tessera.config.model import MLAConfig, ModelConfig, MoEConfig

_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_DSV3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig(family="llama", vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                             ffn_dim=11008, norm_eps=1e-5, max_seq_len=4096),
    "llama3-8b": ModelConfig(family="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0, max_seq_len=8192),
    "llama3.1-8b": ModelConfig(family="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                               n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0, max_seq_len=131072,
                               rope_scaling=_LLAMA3_SCALING),
    "llama3-70b": ModelConfig(family="llama", vocab_size=128256, dim=8192, n_layers=80, n_heads=64,
                              n_kv_heads=8, ffn_dim=28672, rope_theta=500000.0, max_seq_len=8192),
    "mistral-7b": ModelConfig(family="mistral", vocab_size=32768, dim=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, ffn_dim=14336, rope_theta=1e6, max_seq_len=32768),
    "qwen2-7b": ModelConfig(family="qwen2", vocab_size=152064, dim=3584, n_layers=28, n_heads=28,
                            n_kv_heads=4, ffn_dim=18944, norm_eps=1e-6, rope_theta=1e6,
                            max_seq_len=32768, qkv_bias=True),
    "qwen3-8b": ModelConfig(family="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32,
                            n_kv_heads=8, head_dim=128, ffn_dim=12288, norm_eps=1e-6, rope_theta=1e6,
                            max_seq_len=40960, qk_norm=True),
    "mixtral-8x7b": ModelConfig(family="mixtral", vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, ffn_dim=14336, rope_theta=1e6, max_seq_len=32768,
                                moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=14336, aux_loss_coef=0.01)),
    "mixtral-8x22b": ModelConfig(family="mixtral", vocab_size=32768, dim=6144, n_layers=56, n_heads=48,
                                 n_kv_heads=8, ffn_dim=16384, rope_theta=1e6, max_seq_len=65536,
                                 moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=16384, aux_loss_coef=0.01)),
    "qwen2-moe-a2.7b": ModelConfig(family="qwen2_moe", vocab_size=151936, dim=2048, n_layers=24,
                                   n_heads=16, ffn_dim=5632, norm_eps=1e-6, rope_theta=1e6,
                                   max_seq_len=8192, qkv_bias=True,
                                   moe=MoEConfig(num_experts=60, top_k=4, ffn_dim=1408, norm_topk_prob=False,
                                                 shared_ffn_dim=5632, shared_expert_gate=True,
                                                 aux_loss_coef=0.001)),
    "qwen3-30b-a3b": ModelConfig(family="qwen3_moe", vocab_size=151936, dim=2048, n_layers=48, n_heads=32,
                                 n_kv_heads=4, head_dim=128, ffn_dim=6144, norm_eps=1e-6, rope_theta=1e6,
                                 max_seq_len=40960, qk_norm=True,
                                 moe=MoEConfig(num_experts=128, top_k=8, ffn_dim=768, aux_loss_coef=0.001)),
    "deepseek-v3": ModelConfig(family="deepseek_v3", vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
                               ffn_dim=18432, norm_eps=1e-6, max_seq_len=163840, rope_scaling=_DSV3_YARN,
                               mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                             qk_rope_head_dim=64, v_head_dim=128),
                               moe=MoEConfig(num_experts=256, top_k=8, ffn_dim=2048, first_k_dense=3,
                                             score_func="sigmoid", n_groups=8, topk_groups=4,
                                             scaling_factor=2.5, expert_bias=True, shared_ffn_dim=2048,
                                             seq_aux_loss_coef=1e-4)),
    # Tiny shapes for tests and the CPU demo.
    "tiny-llama": ModelConfig(family="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=128, max_seq_len=256),
    "tiny-moe": ModelConfig(family="mixtral", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=128, max_seq_len=256,
                            moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=64, aux_loss_coef=0.01,
                                          z_loss_coef=1e-3)),
    "tiny-deepseek": ModelConfig(family="deepseek_v3", vocab_size=256, dim=64, n_layers=3, n_heads=4,
                                 ffn_dim=128, max_seq_len=256,
                                 mla=MLAConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                               qk_rope_head_dim=8, v_head_dim=16),
                                 moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=32, first_k_dense=1,
                                               score_func="sigmoid", n_groups=4, topk_groups=2,
                                               scaling_factor=2.5, expert_bias=True, shared_ffn_dim=32)),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """A fresh copy of a named configuration, with top-level fields overridden."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model name {name!r}; known: {', '.join(preset_names())}")
    cfg = copy.deepcopy(PRESETS[name])
    if overrides:
        shape_changed = "dim" in overrides or "n_heads" in overrides
        if shape_changed and "head_dim" not in overrides and cfg.head_dim == cfg.dim // cfg.n_heads:
            overrides["head_dim"] = None  # derived from the new dim / n_heads
        cfg = dataclasses.replace(cfg, **overrides)
    return cfg
