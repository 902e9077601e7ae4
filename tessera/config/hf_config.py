"""HuggingFace `config.json` <-> `ModelConfig` for the supported families.

`read_hf_config(dir)` checks the file as untrusted input (JSON object, required fields, field types;
every problem one CheckpointError naming the file) and builds the `ModelConfig`; the run
configuration's `model.from_hf` and every HuggingFace loader use it. Reads both the legacy keys
(`rope_theta`, `rope_scaling`) and transformers 5's `rope_parameters`; writes the legacy keys, which
every transformers release reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tessera.config.errors import CheckpointError, ConfigError, ModelError
from tessera.config.model import MLAConfig, ModelConfig, MoEConfig

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


# config.json fields read as integers / numbers (when present); a string or a float where an
# integer belongs would otherwise fail deep inside model construction.
_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "moe_intermediate_size", "max_position_embeddings",
               "num_local_experts", "num_experts", "num_experts_per_tok", "decoder_sparse_step",
               "shared_expert_intermediate_size", "sliding_window", "q_lora_rank", "kv_lora_rank",
               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
               "first_k_dense_replace", "n_group", "topk_group")
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "router_aux_loss_coef", "router_jitter_noise",
                  "routed_scaling_factor")
_REQUIRED = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError if it cannot be read, parsed, or is not an object."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"cannot read {str(path)!r}: {e.strerror or e}") from e
    except ValueError as e:  # invalid UTF-8 or JSON
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(path)!r} holds a JSON {type(data).__name__}; a JSON object was expected")
    return data


def check_config_fields(d: dict[str, Any], source: Path) -> None:
    """Refuse a config.json whose required fields are missing or whose fields have the wrong type."""
    for key in _REQUIRED:
        if d.get(key) is None:
            raise CheckpointError(f"{str(source)!r}: required field {key!r} is missing")
    for key in _INT_FIELDS:
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CheckpointError(f"{str(source)!r}: {key}={value!r} is invalid: must be an integer")
    for key in _NUMBER_FIELDS:
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise CheckpointError(f"{str(source)!r}: {key}={value!r} is invalid: must be a number")


def aux_coef_from_hf(coef: float, top_k: int, n_layers: int) -> float:
    """HF's router_aux_loss_coef multiplies one loss over all layers' tokens pooled, with f_i as the
    fraction of tokens (not slots): about k / L times Tessera's per-layer losses summed (Megatron's
    convention). The same push on the router needs coef * k / L here."""
    return coef * top_k / n_layers


def aux_coef_to_hf(coef: float, top_k: int, n_layers: int) -> float:
    return coef * n_layers / top_k


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta), scaling or None


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a HuggingFace config dict; refuses what Tessera cannot reproduce."""
    family = d.get("model_type")
    if family not in SUPPORTED:
        raise ModelError(f"unsupported architecture model_type={family!r} ({d.get('architectures')}); "
                         f"supported: {', '.join(SUPPORTED)}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"hidden_act={act!r} is not supported; Tessera's MLPs are SwiGLU (silu)")
    if d.get("mlp_bias"):
        raise ModelError("mlp_bias=true is not supported (no family Tessera loads uses it)")
    theta, scaling = _rope(d)
    heads = d["num_attention_heads"]
    kw: dict[str, Any] = dict(
        family=family, vocab_size=d["vocab_size"], dim=d["hidden_size"], n_layers=d["num_hidden_layers"],
        n_heads=heads, n_kv_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim"),
        ffn_dim=d.get("intermediate_size") or d.get("moe_intermediate_size"),
        norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=d.get("max_position_embeddings", 4096), tie_embeddings=bool(d.get("tie_word_embeddings", False)),
    )
    bias = bool(d.get("attention_bias", False))
    if family in ("qwen2", "qwen2_moe"):
        kw["qkv_bias"] = True
    else:
        kw["qkv_bias"] = kw["out_bias"] = bias
    if family in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = True
    if family in ("mistral", "mixtral"):
        kw["sliding_window"] = d.get("sliding_window")
    elif d.get("use_sliding_window"):
        raise ModelError(f"use_sliding_window=true is not supported for {family} (per-layer windows)")
    n_layers = d["num_hidden_layers"]
    if family == "mixtral":
        n_experts = d.get("num_local_experts") or d.get("num_experts")
        kw["moe"] = MoEConfig(num_experts=n_experts, top_k=d["num_experts_per_tok"],
                              ffn_dim=d["intermediate_size"],
                              aux_loss_coef=aux_coef_from_hf(d.get("router_aux_loss_coef", 0.0),
                                                             d["num_experts_per_tok"], n_layers),
                              jitter_eps=d.get("router_jitter_noise", 0.0) or 0.0)
    elif family in ("qwen2_moe", "qwen3_moe"):
        step, only = d.get("decoder_sparse_step", 1), list(d.get("mlp_only_layers") or [])
        dense = [i for i in range(n_layers) if i in only or (i + 1) % step != 0]
        n_experts = d.get("num_experts") or d.get("num_local_experts")  # transformers 5 renamed it
        kw["moe"] = MoEConfig(num_experts=n_experts, top_k=d["num_experts_per_tok"],
                              ffn_dim=d["moe_intermediate_size"], dense_layers=dense,
                              norm_topk_prob=bool(d.get("norm_topk_prob", family == "qwen3_moe")),
                              aux_loss_coef=aux_coef_from_hf(d.get("router_aux_loss_coef", 0.0),
                                                             d["num_experts_per_tok"], n_layers),
                              shared_ffn_dim=(d.get("shared_expert_intermediate_size", 0)
                                              if family == "qwen2_moe" else 0),
                              shared_expert_gate=family == "qwen2_moe")
    elif family == "deepseek_v3":
        if bias:
            raise ModelError("attention_bias=true is not supported for deepseek_v3")
        kw["head_dim"] = None
        kw["mla"] = MLAConfig(q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
                              qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
                              v_head_dim=d["v_head_dim"], rope_interleave=bool(d.get("rope_interleave", True)))
        kw["moe"] = MoEConfig(num_experts=d["n_routed_experts"], top_k=d["num_experts_per_tok"],
                              ffn_dim=d["moe_intermediate_size"], first_k_dense=d.get("first_k_dense_replace", 0),
                              score_func="sigmoid", norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                              scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                              n_groups=d.get("n_group", 1) or 1, topk_groups=d.get("topk_group", 1) or 1,
                              expert_bias=True,
                              shared_ffn_dim=d["moe_intermediate_size"] * (d.get("n_shared_experts") or 0))
    return ModelConfig(**kw)


def is_hf_directory(path: str | os.PathLike) -> bool:
    """A HuggingFace model directory is one with a config.json (what else it must hold is checked on load)."""
    return (Path(path) / "config.json").is_file()


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of HuggingFace model directory `path`, from its config.json (checked)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json (not a HuggingFace model directory)")
    d = read_json_object(cfg_file)
    check_config_fields(d, cfg_file)
    try:
        return config_from_hf(d)
    except ModelError:  # an architecture Tessera does not reproduce: already names the field
        raise
    except ConfigError as e:  # values that do not fit together: a bad file, not a bad command line
        raise CheckpointError(f"{str(cfg_file)!r}: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{str(cfg_file)!r}: required field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{str(cfg_file)!r}: a field has the wrong type ({e})") from e


# Fields that decide the weights' shapes (nested ones dotted; a whole `moe` / `mla` section present in
# one model only counts too): the ones a shape mismatch is about.
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "tie_embeddings",
                "qkv_bias", "out_bias", "qk_norm", "moe", "moe.num_experts", "moe.ffn_dim", "moe.shared_ffn_dim",
                "moe.shared_expert_gate", "moe.first_k_dense", "moe.dense_layers", "moe.layer_freq",
                "moe.expert_bias", "mla", "mla.q_lora_rank", "mla.kv_lora_rank", "mla.qk_nope_head_dim",
                "mla.qk_rope_head_dim", "mla.v_head_dim")


def model_differences(mine: ModelConfig, theirs: ModelConfig, shapes_only: bool = False) -> list[str]:
    """'field (A here, B there)' for every field (nested ones dotted) where two models differ, or
    only for those that decide weight shapes (SHAPE_FIELDS)."""
    def walk(a: Any, b: Any, key: str) -> list[tuple[str, str]]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in sorted(a.keys() | b.keys()) for d in walk(a.get(k), b.get(k), f"{key}.{k}".lstrip("."))]
        return [] if a == b else [(key, f"{key} ({a!r} here, {b!r} there)")]
    return [text for key, text in walk(mine.to_dict(), theirs.to_dict(), "") if not shapes_only or key in SHAPE_FIELDS]


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HuggingFace config dict of the family recorded in `cfg.family`."""
    family = cfg.family
    d: dict[str, Any] = {
        "architectures": [SUPPORTED[family]], "model_type": family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
    }
    if cfg.mla is None:
        d["head_dim"] = cfg.head_dim
    if family in ("llama", "qwen3", "qwen3_moe", "mistral", "mixtral"):
        if cfg.qkv_bias != cfg.out_bias:
            raise ModelError(f"{family} has one attention_bias for q, k, v and o; got qkv_bias={cfg.qkv_bias}, "
                             f"out_bias={cfg.out_bias}")
        d["attention_bias"] = cfg.qkv_bias
    elif family in ("qwen2", "qwen2_moe") and (not cfg.qkv_bias or cfg.out_bias):
        raise ModelError(f"{family} always has q/k/v biases and no output bias")
    if family in ("mistral", "mixtral"):
        d["sliding_window"] = cfg.sliding_window
    if family in ("qwen3", "qwen3_moe") and not cfg.qk_norm:
        raise ModelError(f"{family} always has QK norm (model.qk_norm must be true)")
    if family not in ("qwen3", "qwen3_moe") and cfg.qk_norm:
        raise ModelError(f"{family} has no QK norm; export to qwen3 / qwen3_moe instead")
    e = cfg.moe
    if family == "mixtral":
        d.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k, intermediate_size=e.ffn_dim,
                 router_aux_loss_coef=aux_coef_to_hf(e.aux_loss_coef, e.top_k, cfg.n_layers),
                 router_jitter_noise=e.jitter_eps)
    elif family in ("qwen2_moe", "qwen3_moe"):
        d.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.ffn_dim,
                 norm_topk_prob=e.norm_topk_prob, decoder_sparse_step=1,
                 router_aux_loss_coef=aux_coef_to_hf(e.aux_loss_coef, e.top_k, cfg.n_layers),
                 mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)])
        if family == "qwen2_moe":
            d["shared_expert_intermediate_size"] = e.shared_ffn_dim
    elif family == "deepseek_v3":
        m = cfg.mla
        if e.shared_ffn_dim % e.ffn_dim:
            raise ModelError("deepseek_v3 needs moe.shared_ffn_dim to be a multiple of moe.ffn_dim")
        d.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                 qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave,
                 n_routed_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.ffn_dim,
                 n_shared_experts=e.shared_ffn_dim // e.ffn_dim, first_k_dense_replace=e.first_k_dense,
                 n_group=e.n_groups, topk_group=e.topk_groups, routed_scaling_factor=e.scaling_factor,
                 norm_topk_prob=e.norm_topk_prob, attention_bias=False)
    return d
