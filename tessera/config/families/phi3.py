"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): LLaMA's decoder whose q, k and v projections are one
tensor (`qkv_proj`, rows in that order) and whose MLP's gate and up projections are one
(`gate_up_proj`, gate first): Tessera keeps its separate projections, each read as its rows of the
fused tensor and joined again on export (`fused_rows`). A `sliding_window` applies to every layer
(Mistral's). Long context is LongRoPE (`rope_scaling` of type longrope, legacy "su"; its
`original_max_position_embeddings` is a top-level field here, which transformers puts first), and
Phi-4-mini rotates only the first `partial_rotary_factor` of each head."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.base import Family, rope_from_hf


def longrope_from_hf(d: Mapping[str, Any]) -> dict[str, Any] | None:
    """The rope scaling as Tessera keeps it: LongRoPE with its original length and factor explicit,
    as transformers' Phi3Config resolves them."""
    _, scaling = rope_from_hf(d)
    if scaling is None:
        return None
    if scaling.get("rope_type") in ("su", "yarn"):  # Phi3Config reads both as longrope
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type") != "longrope":
        raise ModelError(f"phi3 rope_scaling={scaling!r} is not supported: Phi3ForCausalLM takes rope_type longrope")
    original = d.get("original_max_position_embeddings", 4096)
    scaling.pop("partial_rotary_factor", None)
    scaling["original_max_position_embeddings"] = original
    scaling.setdefault("factor", d.get("max_position_embeddings", 4096) / original)
    return scaling


_DEFAULT_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000}  # Phi3Config's


@dataclass(frozen=True)
class Phi3(Family):
    own_parts: ClassVar[tuple[str, ...]] = ("partial_rotary_factor", "rope_scaling")

    def config_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        params = d.get("rope_parameters") or {}
        factor = d.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
        fields = super().config_from_hf({k: v for k, v in d.items() if k not in ("rope_scaling", "rope_parameters")}
                                        | {"rope_theta": params.get("rope_theta", d.get("rope_theta", 10000.0))})
        fields.update(rope_scaling=longrope_from_hf(d), partial_rotary_factor=float(factor))
        return fields

    def config_to_hf(self, cfg) -> dict[str, Any]:
        """config.json; a vocabulary without the class's default token ids says it has none of them
        (transformers would otherwise build an embedding whose padding row it does not have)."""
        d = super().config_to_hf(cfg)
        d.update({k: None for k, v in _DEFAULT_TOKEN_IDS.items() if v >= cfg.vocab_size})
        if cfg.partial_rotary_factor != 1:
            d["partial_rotary_factor"] = cfg.partial_rotary_factor
        if cfg.rope_scaling is not None:
            if cfg.rope_scaling.get("rope_type") != "longrope":
                raise ModelError(f"phi3 has LongRoPE or no scaling (model.rope_scaling.rope_type="
                                 f"{cfg.rope_scaling.get('rope_type')!r}); export it as llama or qwen2")
            if cfg.head_dim != cfg.dim // cfg.n_heads:  # transformers sizes the tables by hidden_size // heads
                raise ModelError(f"phi3's LongRoPE tables are sized by hidden_size // num_attention_heads in "
                                 f"transformers ({cfg.dim} // {cfg.n_heads}), not model.head_dim={cfg.head_dim}; "
                                 "export a model whose head_dim is dim // n_heads")
            d["original_max_position_embeddings"] = cfg.rope_scaling["original_max_position_embeddings"]
            d["rope_scaling"] = {k: v for k, v in cfg.rope_scaling.items() if k != "original_max_position_embeddings"}
        return d

    def attention_names(self, cfg, i: int) -> dict[str, list[str]]:
        src = f"model.layers.{i}.self_attn"
        out = {f"layers.{i}.attention.{n}.weight": [f"{src}.qkv_proj.weight"] for n in ("wq", "wk", "wv")}
        out[f"layers.{i}.attention.wo.weight"] = [f"{src}.o_proj.weight"]
        return out

    def ffn_names(self, cfg, i: int) -> dict[str, list[str]]:
        src = f"model.layers.{i}.mlp"
        return {f"layers.{i}.feed_forward.w1.weight": [f"{src}.gate_up_proj.weight"],
                f"layers.{i}.feed_forward.w3.weight": [f"{src}.gate_up_proj.weight"],
                f"layers.{i}.feed_forward.w2.weight": [f"{src}.down_proj.weight"]}

    def fused_rows(self, cfg) -> dict[str, tuple[int, int]]:
        q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
        rows: dict[str, tuple[int, int]] = {}
        for i in range(cfg.n_layers):
            a, m = f"layers.{i}.attention", f"layers.{i}.feed_forward"
            rows.update({f"{a}.wq.weight": (0, q), f"{a}.wk.weight": (q, q + kv),
                         f"{a}.wv.weight": (q + kv, q + 2 * kv), f"{m}.w1.weight": (0, f),
                         f"{m}.w3.weight": (f, 2 * f)})
        return rows

    def check_exportable(self, cfg) -> None:
        if cfg.qkv_bias or cfg.out_bias:
            raise ModelError("phi3's projections have no biases (model.qkv_bias and model.out_bias must be false)")


# The LongRoPE factor tables are searched per checkpoint and ship in its config.json (`train.init_from`
# or `model.from_hf` read them); these presets give the published shapes, their long-context ones
# with unit tables (plain RoPE, LongRoPE's attention temperature) until a checkpoint's are read.
def _unit_longrope(pairs: int, factor: float) -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": [1.0] * pairs, "long_factor": [1.0] * pairs, "factor": factor,
            "original_max_position_embeddings": 4096}


_MINI = dict(vocab_size=32064, dim=3072, n_layers=32, n_heads=32, ffn_dim=8192, norm_eps=1e-5, rope_theta=10000.0)
FAMILY = Phi3(name="phi3", architecture="Phi3ForCausalLM", sliding_window=True,
              int_fields=("sliding_window", "original_max_position_embeddings"),
              number_fields=("partial_rotary_factor",), presets={
    # microsoft/Phi-3-mini-4k-instruct, Phi-3-mini-128k-instruct, Phi-4-mini-instruct
    "phi3-mini-4k": dict(**_MINI, max_seq_len=4096, sliding_window=2047),
    "phi3-mini-128k": dict(**_MINI, max_seq_len=131072, sliding_window=262144, rope_scaling=_unit_longrope(48, 32.0)),
    "phi4-mini": dict(vocab_size=200064, dim=3072, n_layers=32, n_heads=24, n_kv_heads=8, ffn_dim=8192, norm_eps=1e-5,
                      rope_theta=10000.0, max_seq_len=131072, sliding_window=262144, tie_embeddings=True,
                      partial_rotary_factor=0.75, rope_scaling=_unit_longrope(48, 32.0)),
})
