"""Llama 4 text (Llama4ForCausalLM, model_type llama4_text): LLaMA's pre-norm decoder where every
`no_rope_layer_interval`-th layer has no RoPE (`no_rope_layers`' zeros: `model.nope_layers`) and
scales its queries by a temperature growing with the position (`attn_temperature_tuning`, `attn_scale`,
`floor_scale`: `model.nope_attn_scale`, `model.nope_floor_scale`); the other layers attend within
chunks of `attention_chunk_size` positions (`model.attention_chunk_size`), rotate adjacent pairs
(`model.rope_interleave`) and, with `use_qk_norm`, divide q and k by their RMS (`model.qk_l2_norm`).
Its MoE layers (`moe_layers`, every `interleave_moe_layer_step`-th by default; the others dense MLPs
of `intermediate_size_mlp`) route each token to one expert by a sigmoid gate that scales the token
going in (`model.moe.gate_input`) and add a shared expert of the experts' size (`intermediate_size`).

Its experts are stored fused, `experts.gate_up_proj` [E, D, 2F] and `experts.down_proj` [E, F, D]:
Tessera's w1 and w3 are the transposed halves of the first, w2 the transposed second (`tensor_parts`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ConfigError, ModelError
from tessera.config.families.base import MLP, TensorPart
from tessera.config.families.moe import MoEFamily, aux_coef_from_hf, aux_coef_to_hf
from tessera.config.families.smollm3 import nope_layers_from_hf

CHUNKED, FULL = "chunked_attention", "full_attention"


def moe_layers_from_hf(d: Mapping[str, Any]) -> list[int]:
    n_layers, layers = d["num_hidden_layers"], d.get("moe_layers")
    if layers is None:
        step = d.get("interleave_moe_layer_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"interleave_moe_layer_step={step!r} is invalid: must be an integer >= 1")
        return list(range(step - 1, n_layers, step))
    if not isinstance(layers, list) or any(type(i) is not int or not 0 <= i < n_layers for i in layers):
        raise ConfigError(f"moe_layers={layers!r} is invalid: must list layer indices in 0..{n_layers - 1}")
    return sorted(set(layers))


@dataclass(frozen=True)
class Llama4Text(MoEFamily):
    moe_block: str = "feed_forward"
    nope: ClassVar[bool] = True
    chunked_attention: ClassVar[bool] = True

    def config_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().config_from_hf(d)
        fields["ffn_dim"] = d.get("intermediate_size_mlp", 16384)  # the dense layers'
        return fields

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().attention_from_hf(d)
        nope = nope_layers_from_hf(d)
        chunk = d.get("attention_chunk_size", 8192)
        want = [FULL if i in nope or chunk is None else CHUNKED for i in range(d["num_hidden_layers"])]
        types = d.get("layer_types")
        if types is not None and list(types)[:len(want)] != want:
            raise ModelError(f"layer_types={types!r} is not supported: Tessera's Llama 4 attends in chunks on exactly "
                             f"the layers with RoPE ({want})")
        tuning = d.get("attn_temperature_tuning", True)
        fields.update(nope_layers=nope, attention_chunk_size=chunk, qk_l2_norm=bool(d.get("use_qk_norm", True)),
                      nope_attn_scale=float(d.get("attn_scale", 0.1)) if tuning else 0.0,
                      nope_floor_scale=d.get("floor_scale", 8192), rope_interleave=True)
        return fields

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        if not cfg.rope_interleave:
            raise ModelError("llama4_text rotates adjacent pairs (model.rope_interleave must be true)")
        super().attention_to_hf(cfg.__class__(**{**cfg.to_dict(), "nope_layers": [], "rope_interleave": False,
                                                 "attention_chunk_size": None}), d)
        chunk = cfg.attention_chunk_size
        d.update(no_rope_layers=[int(i not in cfg.nope_layers) for i in range(cfg.n_layers)],
                 attention_chunk_size=chunk, use_qk_norm=cfg.qk_l2_norm,
                 layer_types=[FULL if i in cfg.nope_layers or chunk is None else CHUNKED for i in range(cfg.n_layers)],
                 attn_temperature_tuning=cfg.nope_attn_scale > 0, attn_scale=cfg.nope_attn_scale or 0.1,
                 floor_scale=cfg.nope_floor_scale, intermediate_size_mlp=cfg.ffn_dim)

    def moe_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        n_layers, top_k, moe = d["num_hidden_layers"], d.get("num_experts_per_tok", 1), moe_layers_from_hf(d)
        return dict(num_experts=d.get("num_local_experts", 16), top_k=top_k, ffn_dim=d.get("intermediate_size", 8192),
                    dense_layers=[i for i in range(n_layers) if i not in moe], score_func="sigmoid",
                    norm_topk_prob=False, gate_input=True, shared_ffn_dim=d.get("intermediate_size", 8192),
                    aux_loss_coef=aux_coef_from_hf(d.get("router_aux_loss_coef", 0.0), top_k, n_layers))

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        e = cfg.moe
        d.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k, intermediate_size=e.ffn_dim,
                 moe_layers=cfg.moe_layers, interleave_moe_layer_step=1,
                 router_aux_loss_coef=aux_coef_to_hf(e.aux_loss_coef, e.top_k, cfg.n_layers))

    def moe_requirements(self, e) -> dict[str, Any]:
        return super().moe_requirements(e) | {"score_func": "sigmoid", "top_k": 1, "norm_topk_prob": False,
                                              "gate_input": True, "shared_ffn_dim": e.ffn_dim,
                                              "shared_expert_gate": False}

    def ffn_names(self, cfg, i: int) -> dict[str, list[str]]:
        block = f"model.layers.{i}.feed_forward"
        if not cfg.is_moe_layer(i):
            return {f"layers.{i}.feed_forward.{n}.weight": [f"{block}.{h}.weight"] for n, h in MLP.items()}
        out = {f"layers.{i}.moe.router.weight": [f"{block}.router.weight"]}
        out.update({f"layers.{i}.moe.experts.{n}": [f"{block}.experts.{h}"]
                    for n, h in (("w1", "gate_up_proj"), ("w2", "down_proj"), ("w3", "gate_up_proj"))})
        out.update({f"layers.{i}.moe.shared_experts.{n}.weight": [f"{block}.shared_expert.{h}.weight"]
                    for n, h in MLP.items()})
        return out

    def tensor_parts(self, cfg) -> dict[str, TensorPart]:
        parts = {}
        for i in cfg.moe_layers:
            for n, index, count in (("w1", 0, 2), ("w3", 1, 2), ("w2", 0, 1)):
                parts[f"layers.{i}.moe.experts.{n}"] = TensorPart(index, count)
        return parts


_LLAMA4 = dict(vocab_size=202048, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128, ffn_dim=16384,
               norm_eps=1e-5, rope_theta=500000.0, nope_layers=[i for i in range(48) if (i + 1) % 4 == 0],
               attention_chunk_size=8192, nope_attn_scale=0.1, nope_floor_scale=8192, rope_interleave=True)
_EXPERTS = dict(top_k=1, ffn_dim=8192, shared_ffn_dim=8192, score_func="sigmoid", norm_topk_prob=False,
                gate_input=True)
FAMILY = Llama4Text(
    name="llama4_text", architecture="Llama4ForCausalLM",
    int_fields=("num_local_experts", "num_experts_per_tok", "intermediate_size_mlp", "attention_chunk_size",
                "floor_scale", "interleave_moe_layer_step", "no_rope_layer_interval"),
    number_fields=("attn_scale", "router_aux_loss_coef"),
    presets={
        # meta-llama/Llama-4-Scout-17B-16E (text): 16 experts in every layer, QK norm, llama3 RoPE x16
        "llama4-scout-17b-16e": dict(**_LLAMA4, max_seq_len=10485760, qk_l2_norm=True, rope_scaling={
            "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192}, moe=dict(num_experts=16, **_EXPERTS)),
        # meta-llama/Llama-4-Maverick-17B-128E (text): 128 experts in every other layer, no QK norm
        "llama4-maverick-17b-128e": dict(**_LLAMA4, max_seq_len=1048576, moe=dict(
            num_experts=128, dense_layers=list(range(0, 48, 2)), **_EXPERTS)),
    },
)
