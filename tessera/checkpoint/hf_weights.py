"""Tensor names between Tessera and HuggingFace checkpoints.

`hf_names(cfg)` maps every Tessera state-dict key to the HuggingFace key(s) that hold it. Routed
experts are one [E, out, in] tensor in Tessera and E separate tensors in HuggingFace checkpoints,
so their entry lists E keys, stacked on load and split on save.
"""

from __future__ import annotations

from tessera.config.errors import ModelError
from tessera.config.model import ModelConfig

# HuggingFace tensors no Tessera tensor comes from (recomputed buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
_MLA = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
        "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_MLP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_MIXTRAL_EXPERT = {"w1": "w1", "w2": "w2", "w3": "w3"}


def _attention(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    src, out = f"model.layers.{i}.self_attn", {}
    if cfg.mla is not None:
        names = ["wq"] if cfg.mla.q_lora_rank is None else ["wq_a", "q_norm", "wq_b"]
        for n in names + ["wkv_a", "kv_norm", "wkv_b", "wo"]:
            out[f"layers.{i}.attention.{n}.weight"] = [f"{src}.{_MLA[n]}.weight"]
        return out
    for n in ("wq", "wk", "wv", "wo"):
        out[f"layers.{i}.attention.{n}.weight"] = [f"{src}.{_ATTN[n]}.weight"]
        if (cfg.qkv_bias and n != "wo") or (cfg.out_bias and n == "wo"):
            out[f"layers.{i}.attention.{n}.bias"] = [f"{src}.{_ATTN[n]}.bias"]
    if cfg.qk_norm:
        for n in ("q_norm", "k_norm"):
            out[f"layers.{i}.attention.{n}.weight"] = [f"{src}.{n}.weight"]
    return out


def _ffn(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    if not cfg.is_moe_layer(i):
        for n, h in _MLP.items():
            out[f"layers.{i}.feed_forward.{n}.weight"] = [f"model.layers.{i}.mlp.{h}.weight"]
        return out
    e = cfg.moe
    block = f"model.layers.{i}.block_sparse_moe" if cfg.family == "mixtral" else f"model.layers.{i}.mlp"
    expert_names = _MIXTRAL_EXPERT if cfg.family == "mixtral" else _MLP
    out[f"layers.{i}.moe.router.weight"] = [f"{block}.gate.weight"]
    if e.expert_bias:
        out[f"layers.{i}.moe.router.expert_bias"] = [f"{block}.gate.e_score_correction_bias"]
    for n, h in expert_names.items():
        out[f"layers.{i}.moe.experts.{n}"] = [f"{block}.experts.{j}.{h}.weight" for j in range(e.num_experts)]
    if e.shared_ffn_dim:
        shared = "shared_expert" if cfg.family == "qwen2_moe" else "shared_experts"
        for n, h in _MLP.items():
            out[f"layers.{i}.moe.shared_experts.{n}.weight"] = [f"{block}.{shared}.{h}.weight"]
    if e.shared_expert_gate:
        out[f"layers.{i}.moe.shared_gate.weight"] = [f"{block}.shared_expert_gate.weight"]
    return out


def hf_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Tessera key -> HuggingFace key(s), in model order."""
    names: dict[str, list[str]] = {"tok_embeddings.weight": ["model.embed_tokens.weight"]}
    for i in range(cfg.n_layers):
        names[f"layers.{i}.attention_norm.weight"] = [f"model.layers.{i}.input_layernorm.weight"]
        names.update(_attention(cfg, i))
        names[f"layers.{i}.ffn_norm.weight"] = [f"model.layers.{i}.post_attention_layernorm.weight"]
        names.update(_ffn(cfg, i))
    names["norm.weight"] = ["model.norm.weight"]
    if not cfg.tie_embeddings:
        names["output.weight"] = ["lm_head.weight"]
    return names


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse a model whose forward pass the HuggingFace class of `cfg.family` would not reproduce."""
    e = cfg.moe
    moe_families = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"}
    if (e is not None) != (cfg.family in moe_families):
        raise ModelError(f"model.family={cfg.family!r} does not match model.moe "
                         f"({'set' if e is not None else 'unset'}); MoE families: {sorted(moe_families)}")
    if (cfg.mla is not None) != (cfg.family == "deepseek_v3"):
        raise ModelError("multi-head latent attention (model.mla) exports only as family deepseek_v3")
    if e is None:
        return
    want = {"score_func": "softmax", "softmax_before_topk": True, "scaling_factor": 1.0, "n_groups": 1,
            "expert_bias": False, "first_k_dense": 0, "layer_freq": 1}
    if cfg.family == "deepseek_v3":
        want = {"score_func": "sigmoid", "softmax_before_topk": True, "expert_bias": True, "layer_freq": 1,
                "dense_layers": []}
    elif cfg.family == "mixtral":
        want.update(norm_topk_prob=True, shared_ffn_dim=0, dense_layers=[])
    elif cfg.family in ("qwen2_moe", "qwen3_moe"):  # any dense layers export as mlp_only_layers
        del want["first_k_dense"], want["layer_freq"]
        if cfg.family == "qwen3_moe":
            want["shared_ffn_dim"] = 0
        else:
            want["shared_expert_gate"] = e.shared_ffn_dim > 0
    for key, value in want.items():
        if getattr(e, key) != value:
            raise ModelError(f"model.moe.{key}={getattr(e, key)!r} cannot be exported as {cfg.family} "
                             f"(its HuggingFace class needs {value!r})")
