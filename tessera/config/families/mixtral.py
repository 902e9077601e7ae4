"""Mixtral (MixtralForCausalLM): Mistral's attention, and routed experts in every layer under
`block_sparse_moe`, whose weights keep Tessera's own names (w1, w2, w3)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.config.families.moe import MoEFamily, aux_coef_from_hf, aux_coef_to_hf


@dataclass(frozen=True)
class Mixtral(MoEFamily):
    """Mixtral's expert fields: num_local_experts, intermediate_size (the experts'), router jitter."""

    def moe_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        top_k = d["num_experts_per_tok"]
        return dict(num_experts=d.get("num_local_experts") or d.get("num_experts"), top_k=top_k,
                    ffn_dim=d["intermediate_size"],
                    aux_loss_coef=aux_coef_from_hf(d.get("router_aux_loss_coef", 0.0), top_k, d["num_hidden_layers"]),
                    jitter_eps=d.get("router_jitter_noise", 0.0) or 0.0)

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        e = cfg.moe
        d.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k, intermediate_size=e.ffn_dim,
                 router_aux_loss_coef=aux_coef_to_hf(e.aux_loss_coef, e.top_k, cfg.n_layers),
                 router_jitter_noise=e.jitter_eps)

    def moe_requirements(self, e) -> dict[str, Any]:
        return super().moe_requirements(e) | {"norm_topk_prob": True, "shared_ffn_dim": 0, "dense_layers": []}


FAMILY = Mixtral(
    name="mixtral", architecture="MixtralForCausalLM", sliding_window=True, moe_block="block_sparse_moe",
    expert_projections={"w1": "w1", "w2": "w2", "w3": "w3"},
    int_fields=("sliding_window", "num_experts_per_tok", "num_local_experts", "num_experts"),
    number_fields=("router_aux_loss_coef", "router_jitter_noise"),
    presets={
        "mixtral-8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             rope_theta=1e6, max_seq_len=32768,
                             moe=dict(num_experts=8, top_k=2, ffn_dim=14336, aux_loss_coef=0.01)),
        "mixtral-8x22b": dict(vocab_size=32768, dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384,
                              rope_theta=1e6, max_seq_len=65536,
                              moe=dict(num_experts=8, top_k=2, ffn_dim=16384, aux_loss_coef=0.01)),
        # tests and the CPU demo
        "tiny-moe": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256,
                         moe=dict(num_experts=8, top_k=2, ffn_dim=64, aux_loss_coef=0.01, z_loss_coef=1e-3)),
    },
)
