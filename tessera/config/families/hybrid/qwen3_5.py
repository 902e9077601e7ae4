"""Qwen3.5, text (Qwen3_5ForCausalLM, model_type qwen3_5_text): Qwen3-Next's hybrid decoder
(qwen3_next.py: Gated DeltaNet on three of every four layers, gated partial-rotary attention with QK
norm, (1 + w) norms) with a dense SwiGLU MLP in every layer, and the DeltaNet's input projections
split (`in_proj_qkv` as [q | k | v], `in_proj_z`, `in_proj_b`, `in_proj_a`; model.linear_attention.projections
"split"). Its rotary embedding is multimodal (mrope_section) but rotates a text-only sequence as plain
RoPE: every section reads the same positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tessera.config.families.base import Family
from tessera.config.families.hybrid.qwen3_next import LINEAR_FIELDS, HybridLayers

SPLIT_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
                 "dt_bias", "A_log", "norm.weight", "out_proj.weight")


@dataclass(frozen=True)
class Qwen35Text(HybridLayers, Family):
    int_fields: tuple[str, ...] = tuple(LINEAR_FIELDS) + ("full_attention_interval",)
    number_fields: tuple[str, ...] = ("partial_rotary_factor",)
    projections: ClassVar[str] = "split"
    linear_tensors: ClassVar[tuple[str, ...]] = SPLIT_TENSORS


FAMILY = Qwen35Text(
    name="qwen3_5_text", architecture="Qwen3_5ForCausalLM", qk_norm=True,
    presets={"tiny-qwen3.5": dict(
        vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq_len=256,
        norm_eps=1e-6, qk_norm=True, partial_rotary_factor=0.25, attention_output_gate=True, norm_unit_offset=True,
        linear_attention=dict(layers=[0, 1, 2], n_key_heads=2, n_value_heads=4, key_head_dim=16, value_head_dim=16,
                              conv_width=4, projections="split"))},
)
