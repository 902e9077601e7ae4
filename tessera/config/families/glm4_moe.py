"""GLM-4.5 (Glm4MoeForCausalLM): grouped-query attention with biases on q, k and v only
(`attention_bias`), an optional per-head QK norm (`use_qk_norm`), RoPE on the first
`partial_rotary_factor` of each head (`model.partial_rotary_factor`); DeepSeek-V3's sigmoid routing
over groups of experts with a selection bias (e_score_correction_bias), renormalised and scaled
gate weights, shared experts as a multiple of one expert, and dense MLPs in the first
`first_k_dense_replace` layers. Its multi-token-prediction layer (`num_nextn_predict_layers`) is
not part of the transformers class and is not read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.moe import MoEFamily

DEFAULT_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig default


def partial_rotary_from_hf(d: Mapping[str, Any]) -> float:
    """`partial_rotary_factor` as transformers reads it: in `rope_parameters`, else top level, else 0.5."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    value = params.get("partial_rotary_factor", d.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelError(f"partial_rotary_factor={value!r} is invalid: must be a number in (0, 1]")
    return float(value)


@dataclass(frozen=True)
class Glm4Moe(MoEFamily):
    """GLM-4.5's attention fields (q/k/v biases, QK norm, partial rotary) and expert fields."""

    own_parts: ClassVar[tuple[str, ...]] = ("partial_rotary_factor",)

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        if d.get("use_sliding_window"):
            raise ModelError("use_sliding_window=true is not supported for glm4_moe")
        qk_norm = bool(d.get("use_qk_norm", False))
        return dict(qkv_bias=bool(d.get("attention_bias", False)), out_bias=False, qk_norm=qk_norm,
                    qk_norm_all_heads=False, block_norms="pre", partial_rotary_factor=partial_rotary_from_hf(d))

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        if cfg.out_bias:
            raise ModelError("glm4_moe's output projection has no bias (model.out_bias must be false)")
        if cfg.qk_norm and cfg.qk_norm_all_heads:
            raise ModelError("glm4_moe's QK norm is per head (model.qk_norm_all_heads must be false)")
        if cfg.block_norms != "pre" or cfg.nope_layers:
            raise ModelError(f"glm4_moe's blocks norm before attention and MLP and rotate every layer "
                             f"(model.block_norms={cfg.block_norms!r}, model.nope_layers={cfg.nope_layers})")
        if cfg.window_layers is not None or cfg.local_rope_theta is not None:
            raise ModelError("glm4_moe has no per-layer windows or RoPE (model.window_layers, model.local_rope_theta)")
        self.check_no_window(cfg)
        d.update(attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor)

    def unread_tensor(self, cfg, key: str) -> bool:
        """The multi-token-prediction layer after the last decoder layer, which transformers skips too."""
        parts = key.split(".")
        return key.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= cfg.n_layers

    def moe_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        ffn = d["moe_intermediate_size"]
        return dict(num_experts=d.get("n_routed_experts") or d.get("num_local_experts"), top_k=d["num_experts_per_tok"],
                    ffn_dim=ffn, first_k_dense=d.get("first_k_dense_replace", 1), score_func="sigmoid",
                    norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                    scaling_factor=float(d.get("routed_scaling_factor", 1.0)), n_groups=d.get("n_group", 1) or 1,
                    topk_groups=d.get("topk_group", 1) or 1, expert_bias=True,
                    shared_ffn_dim=ffn * d.get("n_shared_experts", 1))

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        e = cfg.moe
        if e.shared_ffn_dim % e.ffn_dim:
            raise ModelError(f"glm4_moe needs moe.shared_ffn_dim ({e.shared_ffn_dim}) to be a multiple of "
                             f"moe.ffn_dim ({e.ffn_dim}): its shared experts are n_shared_experts experts wide")
        d.update(n_routed_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.ffn_dim,
                 n_shared_experts=e.shared_ffn_dim // e.ffn_dim, first_k_dense_replace=e.first_k_dense,
                 n_group=e.n_groups, topk_group=e.topk_groups, routed_scaling_factor=e.scaling_factor,
                 norm_topk_prob=e.norm_topk_prob)

    def moe_requirements(self, e) -> dict[str, Any]:
        return {"score_func": "sigmoid", "softmax_before_topk": True, "expert_bias": True, "layer_freq": 1,
                "dense_layers": [], "shared_expert_gate": False}


# zai-org/GLM-4.5 and GLM-4.5-Air (config.json): 96 heads of 128 over 8 KV heads, RoPE on half of each head
_GLM = dict(vocab_size=151552, n_heads=96, n_kv_heads=8, head_dim=128, norm_eps=1e-5, rope_theta=1e6,
            max_seq_len=131072, qkv_bias=True, partial_rotary_factor=0.5)
FAMILY = Glm4Moe(
    name="glm4_moe", architecture="Glm4MoeForCausalLM",
    int_fields=("num_experts_per_tok", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group",
                "topk_group"),
    number_fields=("routed_scaling_factor",),
    presets={
        "glm-4.5": dict(dim=5120, n_layers=92, ffn_dim=12288, qk_norm=True, **_GLM,
                        moe=dict(num_experts=160, top_k=8, ffn_dim=1536, first_k_dense=3, score_func="sigmoid",
                                 scaling_factor=2.5, expert_bias=True, shared_ffn_dim=1536)),
        "glm-4.5-air": dict(dim=4096, n_layers=46, ffn_dim=10944, **_GLM,
                            moe=dict(num_experts=128, top_k=8, ffn_dim=1408, first_k_dense=1, score_func="sigmoid",
                                     scaling_factor=1.0, expert_bias=True, shared_ffn_dim=1408)),
        # tests: RoPE on half of each head, q/k/v biases, QK norm, grouped sigmoid routing, a dense first layer
        "tiny-glm4-moe": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                              max_seq_len=256, qkv_bias=True, qk_norm=True, partial_rotary_factor=0.5,
                              moe=dict(num_experts=8, top_k=2, ffn_dim=32, first_k_dense=1, score_func="sigmoid",
                                       n_groups=4, topk_groups=2, scaling_factor=2.5, expert_bias=True,
                                       shared_ffn_dim=32)),
    },
)
