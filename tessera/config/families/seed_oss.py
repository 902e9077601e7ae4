"""Seed-OSS (SeedOssForCausalLM): LLaMA's decoder whose attention has biases on q, k and v
(`attention_bias`, on by default) and, separately, on the output projection (`attention_out_bias`,
off by default); Tessera's `model.qkv_bias` and `model.out_bias`. Its dropouts (`attention_dropout`,
`residual_dropout`) change no forward pass at inference; an export writes them as 0, the training
Tessera did."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.config.families.base import Family


@dataclass(frozen=True)
class SeedOss(Family):
    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().attention_from_hf(d)
        fields.update(qkv_bias=bool(d.get("attention_bias", True)), out_bias=bool(d.get("attention_out_bias", False)))
        return fields

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        # the shared checks with one bias switch; Seed-OSS keeps the two apart
        super().attention_to_hf(cfg.__class__(**{**cfg.to_dict(), "out_bias": cfg.qkv_bias}), d)
        d.update(attention_bias=cfg.qkv_bias, attention_out_bias=cfg.out_bias, attention_dropout=0.0,
                 residual_dropout=0.0)


FAMILY = SeedOss(name="seed_oss", architecture="SeedOssForCausalLM", presets={
    # ByteDance-Seed/Seed-OSS-36B-Base (and -Instruct): biases on q, k, v, none on o; 512K positions
    "seed-oss-36b": dict(vocab_size=155136, dim=5120, n_layers=64, n_heads=80, n_kv_heads=8, head_dim=128,
                         ffn_dim=27648, norm_eps=1e-6, rope_theta=1e7, max_seq_len=524288, qkv_bias=True),
})
