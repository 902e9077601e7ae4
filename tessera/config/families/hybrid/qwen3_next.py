"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid decoder. Three of every four layers mix tokens with
Gated DeltaNet (`layer_types` "linear_attention"; model.linear_attention), the fourth with gated
attention (wq also projects a sigmoid output gate; QK norm; RoPE on the first quarter of each head,
`partial_rotary_factor`). Every RMSNorm but the DeltaNet's gated one scales by (1 + weight);
Qwen2-MoE's experts with their gated shared expert."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.qwen2_moe import QwenMoE

LAYER_TYPES = ("linear_attention", "full_attention")
# config.json's Gated DeltaNet sizes -> model.linear_attention's fields
LINEAR_FIELDS = {"linear_num_key_heads": "n_key_heads", "linear_num_value_heads": "n_value_heads",
                 "linear_key_head_dim": "key_head_dim", "linear_value_head_dim": "value_head_dim",
                 "linear_conv_kernel_dim": "conv_width"}
# the Gated DeltaNet tensors, by the same name in both (Tessera's under layers.{i}.attention)
LINEAR_TENSORS = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
                  "out_proj.weight")


def _layer_types(d: Mapping[str, Any]) -> list[str]:
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:  # transformers' default: full attention every full_attention_interval-th layer
        every = d.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ModelError(f"layer_types={types!r} is invalid: {n} entries, each one of {', '.join(LAYER_TYPES)}")
    return types


class HybridLayers:
    """What a Gated DeltaNet hybrid's class adds to its family (Qwen3-Next's, and Qwen3.5's in
    qwen3_5.py): `layer_types`, the linear-attention sizes, partial rotary, the attention output gate
    and (1 + w) norms in config.json; the DeltaNet tensors by their HuggingFace names, laid out as
    `projections` says (model.linear_attention.projections)."""

    hybrid: ClassVar[bool] = True
    own_parts: ClassVar[tuple[str, ...]] = ("partial_rotary_factor", "norm_unit_offset")  # a quarter rotated; (1 + w)
    projections: ClassVar[str] = "grouped"
    linear_tensors: ClassVar[tuple[str, ...]] = LINEAR_TENSORS

    def config_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().config_from_hf(d)
        head_dim = d.get("head_dim") or 256  # transformers' default
        factor = d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25))
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"] = {k: v for k, v in fields["rope_scaling"].items() if k != "partial_rotary_factor"}
        types = _layer_types(d)
        linear = {ours: d[theirs] for theirs, ours in LINEAR_FIELDS.items() if theirs in d}
        linear["layers"] = [i for i, t in enumerate(types) if t == "linear_attention"]
        linear["projections"] = self.projections
        return fields | dict(head_dim=head_dim, partial_rotary_factor=float(factor), attention_output_gate=True,
                             norm_unit_offset=True, linear_attention=linear)

    def config_to_hf(self, cfg) -> dict[str, Any]:
        la = cfg.linear_attention
        if la is None or not cfg.attention_output_gate or not cfg.norm_unit_offset or not cfg.qk_norm:
            raise ModelError(f"{self.name} needs model.linear_attention, attention_output_gate, norm_unit_offset and "
                             "qk_norm (its HuggingFace class has each)")
        if la.projections != self.projections:
            other = "qwen3_next" if la.projections == "grouped" else "qwen3_5_moe_text" if cfg.moe else "qwen3_5_text"
            raise ModelError(f"{self.name}'s DeltaNet projections are {self.projections} (model.linear_attention."
                             f"projections={la.projections}); export it as {other}")
        d = super().config_to_hf(cfg)
        d["layer_types"] = [LAYER_TYPES[0] if i in la.layers else LAYER_TYPES[1] for i in range(cfg.n_layers)]
        d.update({theirs: getattr(la, ours) for theirs, ours in LINEAR_FIELDS.items()})
        d["partial_rotary_factor"] = cfg.partial_rotary_factor
        return d

    def unread_tensor(self, cfg, key: str) -> bool:
        return key.startswith("mtp.")  # its multi-token-prediction layers, unread as transformers leaves them

    def attention_names(self, cfg, i: int) -> dict[str, list[str]]:
        if not cfg.is_linear_attention_layer(i):
            return super().attention_names(cfg, i)
        return {f"layers.{i}.attention.{n}": [f"model.layers.{i}.linear_attn.{n}"] for n in self.linear_tensors}


@dataclass(frozen=True)
class Qwen3Next(HybridLayers, QwenMoE):
    int_fields: tuple[str, ...] = QwenMoE.int_fields + tuple(LINEAR_FIELDS) + ("full_attention_interval",)
    number_fields: tuple[str, ...] = QwenMoE.number_fields + ("partial_rotary_factor",)


FAMILY = Qwen3Next(
    name="qwen3_next", architecture="Qwen3NextForCausalLM", qk_norm=True, shared_expert="shared_expert",
    norm_topk_default=True,
    presets={"qwen3-next-80b-a3b": dict(
        vocab_size=151936, dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256, ffn_dim=5120,
        norm_eps=1e-6, rope_theta=1e7, max_seq_len=262144, qk_norm=True, partial_rotary_factor=0.25,
        attention_output_gate=True, norm_unit_offset=True,
        linear_attention=dict(layers=[i for i in range(48) if (i + 1) % 4], n_key_heads=16, n_value_heads=32,
                              key_head_dim=128, value_head_dim=128, conv_width=4),
        moe=dict(num_experts=512, top_k=10, ffn_dim=512, shared_ffn_dim=512, shared_expert_gate=True,
                 aux_loss_coef=0.001)),
        "tiny-qwen3-next": dict(
            vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq_len=256,
            norm_eps=1e-6, qk_norm=True, partial_rotary_factor=0.5, attention_output_gate=True, norm_unit_offset=True,
            linear_attention=dict(layers=[0, 1, 2], n_key_heads=2, n_value_heads=4, key_head_dim=16,
                                  value_head_dim=16, conv_width=4),
            moe=dict(num_experts=4, top_k=2, ffn_dim=32, shared_ffn_dim=64, shared_expert_gate=True))},
)
