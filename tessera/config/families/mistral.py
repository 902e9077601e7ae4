"""Mistral (MistralForCausalLM): LLaMA's decoder with one sliding attention window for every layer."""

from __future__ import annotations

from tessera.config.families.base import Family

FAMILY = Family(
    name="mistral", architecture="MistralForCausalLM", sliding_window=True, int_fields=("sliding_window",),
    presets={"mistral-7b": dict(vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                rope_theta=1e6, max_seq_len=32768)},
)
