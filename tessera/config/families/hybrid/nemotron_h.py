"""Nemotron-H (NemotronHForCausalLM): a hybrid decoder whose every layer is one sublayer after its own
RMSNorm (`model.sublayers`, tessera/models/sublayer_block.py): a Mamba-2 mixer (model.mamba), softmax
attention without positional encoding (its attention layers are `nope_layers`; the Mamba layers carry
position), or an ungated MLP of relu(x)^2 (`activation` "relu2"). config.json lists the kinds in
`layers_block_type` ("linear_attention", "full_attention", "mlp", "moe") or, in older files, the
`hybrid_override_pattern` string (M, *, -, E). The MoE variants' "moe" layers (`model.moe`, its
`dense_layers` every other layer) route with DeepSeek-V3's sigmoid scores over groups of experts with a
selection bias and a scaling factor, to ungated relu(x)^2 experts (`expert_activation` "relu2", stored
per expert as transformers saves them: `experts.{j}.up_proj` / `down_proj`) beside one relu^2 shared expert;
their latent projections (`moe_latent_size`) are refused by name. Its files name
the tensors `backbone.` (transformers' own module is `model.` and renames them on load and save).

The Mamba-2 step size is clamped below at `time_step_min` (model.mamba.dt_min) in both of Tessera's
forms; transformers clamps it in its chunked form only, so its token-by-token decoding differs from
Tessera's where softplus(dt + dt_bias) falls under that floor (0.001 in the published models)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.base import Family

# config.json -> Tessera
KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# config.json's Mamba-2 fields -> model.mamba's
MAMBA_FIELDS = {"mamba_num_heads": "n_heads", "mamba_head_dim": "head_dim", "ssm_state_size": "state_size",
                "n_groups": "n_groups", "conv_kernel": "conv_width", "chunk_size": "chunk_size"}
# older files' spellings of the same fields (transformers reads both)
LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_chunk_size": "chunk_size",
          "mamba_conv_bias": "use_conv_bias", "mamba_dt_min": "time_step_min"}
MAMBA_TENSORS = ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")
ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
MLP = {"w1": "up_proj", "w2": "down_proj"}


def _block_types(d: Mapping[str, Any]) -> list[str]:
    types = d.get("layers_block_type") or d.get("layer_types")
    if types is None and isinstance(d.get("hybrid_override_pattern"), str):
        pattern = d["hybrid_override_pattern"]
        if any(c not in PATTERN for c in pattern):
            raise ModelError(f"hybrid_override_pattern={pattern!r} is invalid: each character one of "
                             f"{', '.join(PATTERN)}")
        types = [PATTERN[c] for c in pattern]
    if not isinstance(types, list) or not types or any(t not in KINDS for t in types):
        raise ModelError(f"layers_block_type={types!r} is invalid: a list, each one of {', '.join(KINDS)}")
    return types


def _moe_from_hf(d: Mapping[str, Any], kinds: list[str]) -> dict[str, Any] | None:
    """model.moe of the MoE variants' "moe" layers (module docstring); None without any."""
    if "moe" not in kinds:
        return None
    if d.get("moe_latent_size") is not None:
        raise ModelError(f"moe_latent_size={d['moe_latent_size']!r} is not supported for nemotron_h; supported: None "
                         "(experts over the model dim)")
    return dict(num_experts=d.get("n_routed_experts", 8), top_k=d.get("num_experts_per_tok", 2),
                ffn_dim=d.get("moe_intermediate_size", 7688), score_func="sigmoid", expert_bias=True,
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                scaling_factor=float(d.get("routed_scaling_factor", 1.0)), n_groups=d.get("n_group", 1),
                topk_groups=d.get("topk_group", 1), expert_activation="relu2",
                shared_ffn_dim=d.get("moe_shared_expert_intermediate_size", 7688) if d.get("n_shared_experts", 1)
                else 0,
                dense_layers=[i for i, k in enumerate(kinds) if k != "moe"])


def _moe_to_hf(e) -> dict[str, Any]:
    return {"n_routed_experts": e.num_experts, "num_experts_per_tok": e.top_k, "moe_intermediate_size": e.ffn_dim,
            "moe_shared_expert_intermediate_size": e.shared_ffn_dim, "n_shared_experts": 1 if e.shared_ffn_dim else 0,
            "moe_latent_size": None, "norm_topk_prob": e.norm_topk_prob, "routed_scaling_factor": e.scaling_factor,
            "n_group": e.n_groups, "topk_group": e.topk_groups}


def _refuse_parts(d: Mapping[str, Any]) -> None:
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"), ("mlp_bias", False),
                      ("sliding_window", None)):
        if d.get(key, want) != want:
            raise ModelError(f"{key}={d.get(key)!r} is not supported for nemotron_h; supported: {want!r}")


@dataclass(frozen=True)
class NemotronH(Family):
    int_fields: tuple[str, ...] = tuple(MAMBA_FIELDS) + ("mamba_n_groups", "mamba_d_conv", "mamba_chunk_size")
    number_fields: tuple[str, ...] = ("layer_norm_epsilon", "time_step_min", "mamba_dt_min")
    nope: ClassVar[bool] = True
    one_sublayer: ClassVar[bool] = True
    moe_optional: ClassVar[bool] = True
    own_parts: ClassVar[tuple[str, ...]] = ("activation",)

    def config_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        d = {**d, **{new: d[old] for old, new in LEGACY.items() if old in d}}
        _refuse_parts(d)
        kinds = [KINDS[t] for t in _block_types(d)]
        heads = d["num_attention_heads"]
        mamba = {ours: d[theirs] for theirs, ours in MAMBA_FIELDS.items() if theirs in d}
        mamba.update(conv_bias=bool(d.get("use_conv_bias", True)), proj_bias=bool(d.get("use_bias", False)),
                     dt_min=float(d.get("time_step_min", 0.001)))
        return dict(
            family=self.name, vocab_size=d["vocab_size"], dim=d["hidden_size"], n_layers=len(kinds), n_heads=heads,
            n_kv_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            ffn_dim=d.get("intermediate_size", 21504), norm_eps=d.get("layer_norm_epsilon", 1e-5),
            max_seq_len=d.get("max_position_embeddings", 4096), tie_embeddings=bool(d.get("tie_word_embeddings")),
            activation="relu2", sublayers=kinds, nope_layers=[i for i, k in enumerate(kinds) if k == "attention"],
            mamba=mamba if "mamba" in kinds else None, moe=_moe_from_hf(d, kinds))

    def config_to_hf(self, cfg) -> dict[str, Any]:
        self.check_exportable(cfg)
        kinds = [{v: k for k, v in KINDS.items()}[k] for k in cfg.sublayers]
        d: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.name, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim, "layers_block_type": kinds,
            "hybrid_override_pattern": "".join({v: k for k, v in PATTERN.items()}[t] for t in kinds),
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.ffn_dim, "mlp_hidden_act": "relu2", "mlp_bias": False, "attention_bias": False,
            "layer_norm_epsilon": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tie_embeddings}
        m = cfg.mamba
        if m is not None:
            d.update({theirs: getattr(m, ours) for theirs, ours in MAMBA_FIELDS.items()})
            d.update(mamba_hidden_act="silu", use_conv_bias=m.conv_bias, use_bias=m.proj_bias, time_step_min=m.dt_min)
        if cfg.moe is not None:
            d.update(_moe_to_hf(cfg.moe))
        return d

    def check_exportable(self, cfg) -> None:
        attention = [i for i, k in enumerate(cfg.sublayers or []) if k == "attention"]
        ok = (cfg.sublayers is not None and cfg.activation == "relu2" and sorted(cfg.nope_layers) == attention
              and not (cfg.qkv_bias or cfg.out_bias or cfg.qk_norm or cfg.norm_unit_offset or cfg.embed_scale)
              and cfg.sliding_window is None and cfg.block_norms == "pre" and cfg.attention_chunk_size is None
              and cfg.query_pre_attn_scalar is None and not cfg.attention_sinks)
        e = cfg.moe
        ok = ok and (e is None or (e.score_func == "sigmoid" and e.expert_bias and e.expert_activation == "relu2"
                                   and not (e.shared_expert_gate or e.gate_input or e.router_bias)))
        if not ok:
            raise ModelError(f"{self.name} needs model.sublayers, activation=relu2, nope_layers = its attention layers "
                             f"({attention}), pre norms, and no attention biases, QK norm, window or sinks "
                             "(its HuggingFace class has none), and MoE layers of sigmoid routing with a selection "
                             "bias to relu2 experts")
        self.check_mtp_exportable(cfg)

    def unread_tensor(self, cfg, key: str) -> bool:
        return key.startswith("mtp.")  # multi-token-prediction layers, unread as transformers leaves them

    def tensor_names(self, cfg) -> dict[str, list[str]]:
        names: dict[str, list[str]] = {"tok_embeddings.weight": ["backbone.embeddings.weight"]}
        for i, kind in enumerate(cfg.sublayers or []):
            src = f"backbone.layers.{i}"
            norm = "ffn_norm" if kind in ("mlp", "moe") else "attention_norm"
            names[f"layers.{i}.{norm}.weight"] = [f"{src}.norm.weight"]
            names.update(self._sublayer_names(cfg, i, kind))
        names["norm.weight"] = ["backbone.norm_f.weight"]
        if not cfg.tie_embeddings:
            names["output.weight"] = ["lm_head.weight"]
        return names

    @staticmethod
    def _sublayer_names(cfg, i: int, kind: str) -> dict[str, list[str]]:
        src = f"backbone.layers.{i}.mixer"
        if kind == "mlp":
            return {f"layers.{i}.feed_forward.{n}.weight": [f"{src}.{h}.weight"] for n, h in MLP.items()}
        if kind == "attention":
            return {f"layers.{i}.attention.{n}.weight": [f"{src}.{h}.weight"] for n, h in ATTENTION.items()}
        if kind == "moe":
            out = {f"layers.{i}.moe.router.weight": [f"{src}.gate.weight"],
                   f"layers.{i}.moe.router.expert_bias": [f"{src}.gate.e_score_correction_bias"]}
            out.update({f"layers.{i}.moe.experts.{n}": [f"{src}.experts.{j}.{h}.weight"
                                                        for j in range(cfg.moe.num_experts)] for n, h in MLP.items()})
            if cfg.moe.shared_ffn_dim:
                out.update({f"layers.{i}.moe.shared_experts.{n}.weight": [f"{src}.shared_experts.{h}.weight"]
                            for n, h in MLP.items()})
            return out
        parts = list(MAMBA_TENSORS)
        parts += ["conv1d.bias"] if cfg.mamba.conv_bias else []
        parts += ["in_proj.bias", "out_proj.bias"] if cfg.mamba.proj_bias else []
        return {f"layers.{i}.attention.{n}": [f"{src}.{n}"] for n in parts}


# Nemotron-H-8B-Base-8K's shapes (NemotronHConfig's defaults, which describe it): 52 layers, 24 Mamba-2,
# 4 attention, 24 MLP
_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

FAMILY = NemotronH(
    name="nemotron_h", architecture="NemotronHForCausalLM",
    presets={
        "nemotron-h-8b": dict(
            vocab_size=131072, dim=4096, n_layers=52, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=21504,
            norm_eps=1e-5, max_seq_len=8192, activation="relu2",
            sublayers=[KINDS[PATTERN[c]] for c in _8B_PATTERN],
            nope_layers=[i for i, c in enumerate(_8B_PATTERN) if c == "*"],
            mamba=dict(n_heads=128, head_dim=64, state_size=128, n_groups=8, conv_width=4, chunk_size=128)),
        "tiny-nemotron-h": dict(
            vocab_size=256, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq_len=256,
            norm_eps=1e-5, activation="relu2", sublayers=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
            nope_layers=[2], mamba=dict(n_heads=8, head_dim=8, state_size=16, n_groups=2, conv_width=4,
                                        chunk_size=16)),
        # the MoE variants' layers (Nemotron 3): relu^2 experts routed by grouped sigmoid scores with a selection
        # bias, beside a relu^2 shared expert, in place of the first and third MLP layers
        "tiny-nemotron-h-moe": dict(
            vocab_size=256, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq_len=256,
            norm_eps=1e-5, activation="relu2", sublayers=["mamba", "moe", "attention", "mlp", "mamba", "moe"],
            nope_layers=[2], mamba=dict(n_heads=8, head_dim=8, state_size=16, n_groups=2, conv_width=4,
                                        chunk_size=16),
            moe=dict(num_experts=4, top_k=2, ffn_dim=32, score_func="sigmoid", expert_bias=True, n_groups=2,
                     topk_groups=1, scaling_factor=2.5, expert_activation="relu2", shared_ffn_dim=48,
                     dense_layers=[0, 2, 3, 4])),
    },
)
