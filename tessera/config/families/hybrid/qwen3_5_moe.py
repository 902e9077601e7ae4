"""Qwen3.5 MoE, text (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): Qwen3.5's hybrid decoder
(qwen3_5.py: Gated DeltaNet with split projections on three of every four layers, gated partial-rotary
attention) with routed experts and a sigmoid-gated shared expert in every layer, the top-k weights always
renormalised.

Its experts are stored two ways. The published checkpoints (and transformers' model in memory) pack
them: `mlp.experts.gate_up_proj` [E, 2 * ffn, dim] (gate rows first, then up) and `mlp.experts.down_proj`
[E, dim, ffn]; Tessera's w1 and w3 are the two halves of the first (`TensorPart(..., transposed=False)`),
w2 the second. transformers' `save_pretrained` writes one tensor per expert instead
(`mlp.experts.{j}.gate_proj.weight`, ...). Tessera reads either (`unpacked_names`: the reader takes those
where the files hold them) and writes the packed, published form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.base import TensorPart
from tessera.config.families.hybrid.qwen3_5 import SPLIT_TENSORS
from tessera.config.families.hybrid.qwen3_next import LINEAR_FIELDS, HybridLayers
from tessera.config.families.moe import MoEFamily, aux_coef_to_hf
from tessera.config.families.qwen2_moe import QwenMoE

PACKED = (("w1", "gate_up_proj", 0, 2), ("w3", "gate_up_proj", 1, 2), ("w2", "down_proj", 0, 1))


@dataclass(frozen=True)
class Qwen35MoeText(HybridLayers, QwenMoE):
    int_fields: tuple[str, ...] = QwenMoE.int_fields + tuple(LINEAR_FIELDS) + ("full_attention_interval",)
    number_fields: tuple[str, ...] = QwenMoE.number_fields + ("partial_rotary_factor",)
    projections: ClassVar[str] = "split"
    linear_tensors: ClassVar[tuple[str, ...]] = SPLIT_TENSORS

    def config_from_hf(self, d) -> dict[str, Any]:
        return super().config_from_hf(d) | {"ffn_dim": d["moe_intermediate_size"]}  # no dense MLP to size

    def moe_from_hf(self, d) -> dict[str, Any]:
        for key in ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob"):
            if key in d and d[key] not in ([], 1, True, None):
                raise ModelError(f"{key}={d[key]!r} is not supported for {self.name}: its class routes every "
                                 "layer's tokens to renormalised top-k experts")
        return super().moe_from_hf(d)

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        e = cfg.moe
        del d["intermediate_size"]  # the class has no dense MLP
        d.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.ffn_dim,
                 shared_expert_intermediate_size=e.shared_ffn_dim,
                 router_aux_loss_coef=aux_coef_to_hf(e.aux_loss_coef, e.top_k, cfg.n_layers))

    def moe_requirements(self, e) -> dict[str, Any]:
        return super().moe_requirements(e) | {"norm_topk_prob": True, "dense_layers": [], "shared_expert_gate": True}

    def check_exportable(self, cfg) -> None:
        super().check_exportable(cfg)
        if cfg.moe.shared_ffn_dim == 0:
            raise ModelError(f"model.moe.shared_ffn_dim=0 cannot be exported as {self.name} (its class always "
                             "has a gated shared expert)")

    def ffn_names(self, cfg, i: int) -> dict[str, list[str]]:
        out = super().ffn_names(cfg, i)
        block = f"model.layers.{i}.{self.moe_block}.experts"
        out.update({f"layers.{i}.moe.experts.{n}": [f"{block}.{h}"] for n, h, _, _ in PACKED})
        return out

    def tensor_parts(self, cfg) -> dict[str, TensorPart]:
        return {f"layers.{i}.moe.experts.{n}": TensorPart(index, count, transposed=False)
                for i in cfg.moe_layers for n, _, index, count in PACKED}

    def unpacked_names(self, cfg) -> dict[str, list[str]]:
        return {key: names for i in cfg.moe_layers
                for key, names in MoEFamily.ffn_names(self, cfg, i).items() if ".moe.experts." in key}


_QWEN35 = dict(vocab_size=248320, n_kv_heads=2, head_dim=256, norm_eps=1e-6, rope_theta=1e7, max_seq_len=262144,
               qk_norm=True, partial_rotary_factor=0.25, attention_output_gate=True, norm_unit_offset=True)
FAMILY = Qwen35MoeText(
    name="qwen3_5_moe_text", architecture="Qwen3_5MoeForCausalLM", qk_norm=True, shared_expert="shared_expert",
    norm_topk_default=True,
    presets={
        # Qwen/Qwen3.5-35B-A3B and Qwen/Qwen3.5-397B-A17B (text_config): 3 DeltaNet layers to 1 attention layer
        "qwen3.5-35b-a3b": dict(
            **_QWEN35, dim=2048, n_layers=40, n_heads=16, ffn_dim=512,
            linear_attention=dict(layers=[i for i in range(40) if (i + 1) % 4], n_key_heads=16, n_value_heads=32,
                                  key_head_dim=128, value_head_dim=128, conv_width=4, projections="split"),
            moe=dict(num_experts=256, top_k=8, ffn_dim=512, shared_ffn_dim=512, shared_expert_gate=True,
                     aux_loss_coef=0.001)),
        "qwen3.5-397b-a17b": dict(
            **_QWEN35, dim=4096, n_layers=60, n_heads=32, ffn_dim=1024,
            linear_attention=dict(layers=[i for i in range(60) if (i + 1) % 4], n_key_heads=16, n_value_heads=64,
                                  key_head_dim=128, value_head_dim=128, conv_width=4, projections="split"),
            moe=dict(num_experts=512, top_k=10, ffn_dim=1024, shared_ffn_dim=1024, shared_expert_gate=True,
                     aux_loss_coef=0.001)),
        "tiny-qwen3.5-moe": dict(
            vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=32, max_seq_len=256,
            norm_eps=1e-6, qk_norm=True, partial_rotary_factor=0.25, attention_output_gate=True, norm_unit_offset=True,
            linear_attention=dict(layers=[0, 1, 2], n_key_heads=2, n_value_heads=4, key_head_dim=16, value_head_dim=16,
                                  conv_width=4, projections="split"),
            moe=dict(num_experts=4, top_k=2, ffn_dim=32, shared_ffn_dim=64, shared_expert_gate=True))},
)
