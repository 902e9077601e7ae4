"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): Qwen2's attention; routed experts in the layers
`decoder_sparse_step` and `mlp_only_layers` leave sparse, plus one shared expert scaled by a
sigmoid gate. `QwenMoE` maps Qwen3-MoE's config.json too (qwen3_moe.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.config.errors import ConfigError
from tessera.config.families.moe import MoEFamily, aux_coef_from_hf, aux_coef_to_hf


@dataclass(frozen=True)
class QwenMoE(MoEFamily):
    """The expert fields of Qwen's MoE classes: num_experts, moe_intermediate_size, the sparse layers
    (decoder_sparse_step, mlp_only_layers) and, where the class has it, the gated shared expert."""

    has_shared_expert: bool = True  # shared_expert_intermediate_size, and its sigmoid gate
    norm_topk_default: bool = False  # norm_topk_prob when config.json does not say
    int_fields: tuple[str, ...] = ("num_experts_per_tok", "num_experts", "num_local_experts", "decoder_sparse_step",
                                   "shared_expert_intermediate_size")
    number_fields: tuple[str, ...] = ("router_aux_loss_coef",)

    def moe_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        n_layers = d["num_hidden_layers"]
        step, only = d.get("decoder_sparse_step", 1), list(d.get("mlp_only_layers") or [])
        if step < 1:
            raise ConfigError(f"decoder_sparse_step={step} is invalid: must be >= 1 (every step-th layer is sparse)")
        dense = [i for i in range(n_layers) if i in only or (i + 1) % step != 0]
        return dict(num_experts=d.get("num_experts") or d.get("num_local_experts"),  # transformers 5 renamed it
                    top_k=d["num_experts_per_tok"], ffn_dim=d["moe_intermediate_size"], dense_layers=dense,
                    norm_topk_prob=bool(d.get("norm_topk_prob", self.norm_topk_default)),
                    aux_loss_coef=aux_coef_from_hf(d.get("router_aux_loss_coef", 0.0), d["num_experts_per_tok"],
                                                   n_layers),
                    shared_ffn_dim=d.get("shared_expert_intermediate_size", 0) if self.has_shared_expert else 0,
                    shared_expert_gate=self.has_shared_expert)

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        e = cfg.moe
        d.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.ffn_dim,
                 norm_topk_prob=e.norm_topk_prob, decoder_sparse_step=1,
                 router_aux_loss_coef=aux_coef_to_hf(e.aux_loss_coef, e.top_k, cfg.n_layers),
                 mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)])
        if self.has_shared_expert:
            d["shared_expert_intermediate_size"] = e.shared_ffn_dim

    def moe_requirements(self, e) -> dict[str, Any]:
        want = super().moe_requirements(e)
        del want["first_k_dense"], want["layer_freq"]  # any dense layers export as mlp_only_layers
        if self.has_shared_expert:
            want["shared_expert_gate"] = e.shared_ffn_dim > 0
        else:
            want["shared_ffn_dim"] = 0
        return want


FAMILY = QwenMoE(
    name="qwen2_moe", architecture="Qwen2MoeForCausalLM", qkv_bias_only=True, shared_expert="shared_expert",
    presets={"qwen2-moe-a2.7b": dict(vocab_size=151936, dim=2048, n_layers=24, n_heads=16, ffn_dim=5632,
                                     norm_eps=1e-6, rope_theta=1e6, max_seq_len=8192, qkv_bias=True,
                                     moe=dict(num_experts=60, top_k=4, ffn_dim=1408, norm_topk_prob=False,
                                              shared_ffn_dim=5632, shared_expert_gate=True, aux_loss_coef=0.001))},
)
