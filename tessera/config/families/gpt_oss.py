"""gpt-oss (GptOssForCausalLM): attention with biases and a learned sink logit per head
(`model.attention_sinks`), a sliding window on the layers `layer_types` calls "sliding_attention"
(every other one, `model.window_layers`), YaRN on every layer; every layer routed (top-k on the
logits of a router with a bias, softmax over the k), experts with biases and the clamped SwiGLU
(`model.moe.expert_activation: clamped_swiglu`), whose tensors keep HuggingFace's fused, interleaved
layout (models/moe/biased_experts.py). MXFP4 expert weights (`*_blocks` / `*_scales`) are
dequantized at load (tessera/checkpoint/hf/mxfp4.py), or kept packed for serving
(tessera/checkpoint/hf/mxfp4_packed.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ConfigError, ModelError
from tessera.config.families.moe import MoEFamily, aux_coef_from_hf, aux_coef_to_hf

SLIDING, FULL = "sliding_attention", "full_attention"
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@dataclass(frozen=True)
class GptOss(MoEFamily):
    layer_windows: ClassVar[bool] = True

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().attention_from_hf(d)
        n_layers = d["num_hidden_layers"]
        types = d.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n_layers)]
        if not isinstance(types, list) or len(types) < n_layers or any(t not in (SLIDING, FULL) for t in types):
            raise ConfigError(f"layer_types={types!r} is invalid: must list {SLIDING!r} or {FULL!r} for each of the "
                              f"{n_layers} layers")
        sliding = [i for i in range(n_layers) if types[i] == SLIDING]
        fields["attention_sinks"] = True
        if sliding:
            fields.update(sliding_window=d.get("sliding_window") or 128, window_layers=sliding)
        return fields

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        if not cfg.attention_sinks:
            raise ModelError("gpt_oss always has attention sinks (model.attention_sinks must be true)")
        if cfg.sliding_window is not None and cfg.window_layers is None:
            raise ModelError("gpt_oss keeps some layers without a window: give model.window_layers")
        if cfg.local_rope_theta is not None:
            raise ModelError("gpt_oss's sliding layers rotate as its full ones (model.local_rope_theta must be unset)")
        plain = cfg.__class__(**{**cfg.to_dict(), "sliding_window": None, "window_layers": None})
        super().attention_to_hf(plain, d)
        d.update(layer_types=[SLIDING if cfg.layer_window(i) is not None else FULL for i in range(cfg.n_layers)],
                 sliding_window=cfg.sliding_window)

    def moe_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        k, n_layers = d["num_experts_per_tok"], d["num_hidden_layers"]
        return dict(num_experts=d.get("num_local_experts") or d.get("num_experts"), top_k=k,
                    ffn_dim=d["intermediate_size"], score_func="softmax", softmax_before_topk=False,
                    router_bias=True, expert_activation="clamped_swiglu",
                    swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                    aux_loss_coef=aux_coef_from_hf(d.get("router_aux_loss_coef", 0.0), k, n_layers))

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        e = cfg.moe
        d.update(intermediate_size=e.ffn_dim, num_local_experts=e.num_experts, num_experts_per_tok=e.top_k,
                 swiglu_alpha=e.swiglu_alpha, swiglu_limit=e.swiglu_limit,
                 router_aux_loss_coef=aux_coef_to_hf(e.aux_loss_coef, e.top_k, cfg.n_layers))

    def attention_names(self, cfg, i: int) -> dict[str, list[str]]:
        out = super().attention_names(cfg, i)
        out[f"layers.{i}.attention.sinks.weight"] = [f"model.layers.{i}.self_attn.sinks"]
        return out

    def ffn_names(self, cfg, i: int) -> dict[str, list[str]]:
        block = f"model.layers.{i}.mlp"
        out = {f"layers.{i}.moe.router.{n}": [f"{block}.router.{n}"] for n in ("weight", "bias")}
        out.update({f"layers.{i}.moe.experts.{n}": [f"{block}.experts.{n}"] for n in EXPERT_TENSORS})
        return out

    def moe_requirements(self, e) -> dict[str, Any]:
        return {"score_func": "softmax", "softmax_before_topk": False, "scaling_factor": 1.0, "n_groups": 1,
                "expert_bias": False, "first_k_dense": 0, "dense_layers": [], "layer_freq": 1, "shared_ffn_dim": 0,
                "router_bias": True, "expert_activation": "clamped_swiglu"}


# openai/gpt-oss-20b and gpt-oss-120b (config.json): 64 heads of 64 over 8 KV heads, a window of 128 on
# every other layer, YaRN (x32 from 4,096 positions) on all of them
_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
         "beta_slow": 1.0, "truncate": False}
_GPT_OSS = dict(vocab_size=201088, dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880, norm_eps=1e-5,
                rope_theta=150000.0, rope_scaling=_YARN, max_seq_len=131072, qkv_bias=True, out_bias=True,
                attention_sinks=True, sliding_window=128)
_MOE = dict(top_k=4, ffn_dim=2880, softmax_before_topk=False, router_bias=True, expert_activation="clamped_swiglu")
FAMILY = GptOss(
    name="gpt_oss", architecture="GptOssForCausalLM",
    int_fields=("num_local_experts", "num_experts_per_tok", "sliding_window"),
    number_fields=("swiglu_alpha", "swiglu_limit", "router_aux_loss_coef"),
    presets={
        "gpt-oss-20b": dict(n_layers=24, window_layers=list(range(0, 24, 2)), **_GPT_OSS,
                            moe=dict(num_experts=32, **_MOE)),
        "gpt-oss-120b": dict(n_layers=36, window_layers=list(range(0, 36, 2)), **_GPT_OSS,
                             moe=dict(num_experts=128, **_MOE)),
        # tests: sinks, a window on the first layer, biased experts with the clamped SwiGLU
        "tiny-gpt-oss": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=32,
                             max_seq_len=256, qkv_bias=True, out_bias=True, attention_sinks=True, sliding_window=5,
                             window_layers=[0], moe=dict(num_experts=4, top_k=2, ffn_dim=32, softmax_before_topk=False,
                                                         router_bias=True, expert_activation="clamped_swiglu")),
    },
)
