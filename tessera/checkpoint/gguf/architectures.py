"""What differs between the GGUF architectures Tessera reads: the family each loads as, the
per-layer HuggingFace modules whose GGUF names gguf's own tables give, and the config.json fields
llama.cpp's converter leaves to the architecture (reader.py reads the common ones).

- `llama`, `qwen2`: the LLaMA decoder; llama.cpp stores LLaMA's query/key rows permuted (reader.py
  undoes it), Qwen2's in HuggingFace's order.
- `phi3` (Phi-3, Phi-4-mini): q, k and v are one tensor (`attn_qkv`), gate and up one (`ffn_up`,
  gate first), both read as HuggingFace's fused `qkv_proj` / `gate_up_proj`; `rope.dimension_count`
  below the head size is a partial rotary factor, `attention.sliding_window` Mistral's window, and
  LongRoPE's factor tables are the tensors `rope_factors_long` / `rope_factors_short` with the
  original length `rope.scaling.original_context_length`.
- `gemma3` (Gemma 3 text): norms before and after attention and MLP and on q and k; llama.cpp's
  converter stores every RMSNorm weight with Gemma's +1 added (its RMSNorm scales by the weight,
  HuggingFace's by 1 + weight), taken off here. llama.cpp fixes what the metadata leaves out: one
  global layer in six (unless `attention.sliding_window_pattern` says otherwise), the sliding
  layers' RoPE base 10,000 (unless `rope.freq_base_swa`), and the softmax scale head_dim^-0.5
  except for the 62-layer 27B model, whose is (hidden / heads)^-0.5.
- `olmo2` (OLMo 2): norms after attention and MLP (none before), one QK norm over all heads. llama.cpp
  writes OLMo 3 as `olmo2` too, with a sliding window and YaRN: those files are refused (metadata
  `attention.sliding_window`), as is every architecture not listed here.
- `seed_oss` (Seed-OSS): LLaMA's decoder with biases on q, k and v (and on o where the file has them).
For `olmo2` and `seed_oss` the head size is `attention.key_length` and the biases are the file's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera.config.errors import ConfigError

LLAMA_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
               "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class Metadata:
    """An opened file's `{arch}.*` metadata and small tensors, for an architecture's config hook."""

    def __init__(self, path, arch: str, read: Callable[[str], Any], fields, tensor: Callable[[str], Any]):
        self.path, self.arch, self._read, self._fields, self.tensor = path, arch, read, fields, tensor

    def __contains__(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        return self._read(f"{self.arch}.{key}") if key in self else default

    def count(self, key: str, default: int) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{str(self.path)!r}: GGUF metadata {self.arch}.{key} is {value!r}; Tessera reads one "
                              "positive integer")
        return value


@dataclass(frozen=True)
class Architecture:
    family: str  # the Tessera family (HuggingFace model_type) it loads as
    permuted: bool = False  # llama.cpp reordered its query/key rows
    layer_modules: tuple[str, ...] = LLAMA_LAYER
    reads: tuple[str, ...] = ()  # metadata keys refused for the other architectures that this one reads
    config: Callable[[Metadata, dict[str, Any]], dict[str, Any]] | None = None
    config_tensors: tuple[str, ...] = ()  # GGUF tensors that are config values, not weights
    norm_offset: float = 0.0  # what llama.cpp's converter added to every norm weight


def _phi3(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    head_dim = d["hidden_size"] // d["num_attention_heads"]
    out: dict[str, Any] = {"partial_rotary_factor": meta.count("rope.dimension_count", head_dim) / head_dim,
                           "sliding_window": meta.get("attention.sliding_window")}
    long, short = meta.tensor("rope_factors_long"), meta.tensor("rope_factors_short")
    if (long is None) != (short is None):
        raise ConfigError(f"{str(meta.path)!r}: a phi3 file with LongRoPE holds both rope_factors_long and "
                          "rope_factors_short; it holds one")
    if long is not None:
        out["original_max_position_embeddings"] = meta.count("rope.scaling.original_context_length", 4096)
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": [float(x) for x in long],
                               "short_factor": [float(x) for x in short]}
    return out


def _gemma3(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    n, heads = d["num_hidden_layers"], d["num_attention_heads"]
    head_dim = meta.count("attention.key_length", d["hidden_size"] // heads)
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer: true where it slides
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
    else:
        sliding = []
    if len(sliding) != n:
        raise ConfigError(f"{str(meta.path)!r}: GGUF metadata gemma3.attention.sliding_window_pattern is {pattern!r}; "
                          f"Tessera reads a period or one flag for each of the {n} layers")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": d["rope_theta"]}
    scaling = meta.get("rope.scaling.type")
    if scaling == "linear":
        full.update(rope_type="linear", factor=float(meta.get("rope.scaling.factor", 1.0)))
    elif scaling not in (None, "none"):
        raise ConfigError(f"{str(meta.path)!r}: GGUF metadata gemma3.rope.scaling.type is {scaling!r}; Gemma 3 files "
                          "have linear scaling or none")
    return {"head_dim": head_dim, "sliding_window": meta.count("attention.sliding_window", 4096),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}},
            "query_pre_attn_scalar": d["hidden_size"] // heads if n == 62 else head_dim}


def _biases(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    """The head size (`attention.key_length`) and which attention projections have biases (the file's tensors)."""
    return {"head_dim": meta.count("attention.key_length", d["hidden_size"] // d["num_attention_heads"]),
            "attention_bias": meta.tensor("blk.0.attn_q.bias") is not None,
            "attention_out_bias": meta.tensor("blk.0.attn_output.bias") is not None}


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", permuted=True),
    "qwen2": Architecture("qwen2"),
    "phi3": Architecture("phi3", layer_modules=(
        "input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
        "mlp.down_proj"), reads=("attention.sliding_window",), config=_phi3,
        config_tensors=("rope_factors_long", "rope_factors_short")),
    "gemma3": Architecture("gemma3_text", layer_modules=LLAMA_LAYER + (
        "pre_feedforward_layernorm", "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
        reads=("attention.sliding_window", "rope.scaling.type", "rope.scaling.factor"), config=_gemma3,
        norm_offset=1.0),
    "olmo2": Architecture("olmo2", layer_modules=(
        "post_attention_layernorm", "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm",
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"), config=_biases),
    "seed_oss": Architecture("seed_oss", config=_biases),
}
