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
- `smollm3` (SmolLM3): LLaMA's decoder (rows permuted as LLaMA's) with no RoPE on every 4th layer,
  which llama.cpp fixes and transformers' default is.
- `exaone4` (EXAONE 4): OLMo 2's post-norms with per-head QK norms; a sliding window on the layers
  `attention.sliding_window_pattern` flags, the others full and without RoPE.
- `glm4moe` (GLM-4.5): `leading_dense_block_count` dense layers, then routed experts (one [E, out, in]
  tensor each, `ffn_*_exps`) under sigmoid routing with a bias (`exp_probs_b`) and shared experts
  (`ffn_*_shexp`); RoPE on `rope.dimension_count` of each head. Its multi-token-prediction blocks,
  counted in `block_count` (`nextn_predict_layers`), are not read, as transformers does not.
- `gpt-oss`: attention sinks (`attn_sinks`), a window on every other layer from the first, YaRN, a
  router with a bias, and experts whose gate and up llama.cpp stores apart (`ffn_gate_exps`,
  `ffn_up_exps`, [E, out, in], with [E, out] biases) and transformers interleaved in one fused
  [E, in, 2 x out] tensor: each is written into its columns. Experts are often MXFP4.
- `llama4` (Llama 4 text): every `interleave_moe_layer_step`-th layer routed (top-1, a sigmoid gate on
  the input) beside a shared expert (`ffn_*_shexp`), the others dense; experts [E, out, in] as
  Tessera holds them (`#i` names the i-th part of HuggingFace's fused tensor). What llama.cpp fixes
  and its metadata leaves out: no RoPE on every 4th layer, chunks of 8,192 on the others (none where
  `attention.sliding_window` is 0), the NoPE layers' temperature (`attention.temperature_scale`,
  `attention.temperature_length`, else 0.1 and 8,192), and the L2 QK norm except for the 128-expert
  model (Maverick). Rows are stored unpermuted (HuggingFace's Llama 4 rotates adjacent pairs).
- `qwen3next` (Qwen3-Next): three Gated DeltaNet layers in four (`full_attention_interval`), the
  fourth gated attention (q_proj's per-head query and gate, stored as HuggingFace's); Qwen2-MoE's
  experts (`ffn_*_exps`) with a gated shared expert. llama.cpp's converter stores every norm but the
  DeltaNet's (`ssm_norm`) with +1 added, A as -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the
  conv kernel without its middle dimension, and HuggingFace's in_proj_qkvz (per key head: q, k, v, z)
  cut in two: `attn_qkv` (every head's q, then k, then v) and `attn_gate` (z); each is written back
  into its rows of the key heads' groups. Sizes: `ssm.group_count` key heads of `ssm.state_size`,
  `ssm.time_step_rank` value heads making `ssm.inner_size`, `ssm.conv_kernel`.
- `qwen35`, `qwen35moe` (Qwen3.5 text, dense and MoE): Qwen3-Next's conventions (norms +1 but
  `ssm_norm`, `ssm_a`, `ssm_dt.bias`, the squeezed conv) with the DeltaNet projections apart as
  HuggingFace's are (`attn_qkv` [q | k | v] = in_proj_qkv, `attn_gate` = in_proj_z, `ssm_beta`,
  `ssm_alpha`), every value-head dimension stored tiled (each key head's first value head, then each
  one's second, ...) where HuggingFace groups value heads by key head: `_untiled` puts them back (the
  rows of attn_qkv's v, attn_gate, alpha and beta as a row order, `rows`, which quantized blocks keep
  too; A, dt_bias, the conv's v channels and ssm_out's columns by `convert`). The MoE's experts are
  stored apart (`ffn_*_exps`) and read as the parts of HuggingFace's packed tensors; its files have no
  `feed_forward_length` (no dense MLP). `rope.dimension_sections` (multimodal RoPE) is not read: a text
  sequence's sections all read the same positions.
Llama 3's RoPE scaling (LLaMA, SmolLM3, EXAONE 4, Llama 4) is the tensor `rope_freqs`, read back as
`rope_scaling` by rope_freqs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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
    placed: dict[str, Placed] | None = None  # per-layer GGUF tensors stored otherwise in HuggingFace
    rope_freqs: bool = False  # Llama 3's RoPE scaling may be the tensor rope_freqs
    extra_blocks: bool = False  # blocks past num_hidden_layers (multi-token prediction) are skipped
    unshifted: tuple[str, ...] = ()  # norms (GGUF kinds) stored without norm_offset
    optional: tuple[str, ...] = ()  # metadata keys read for every architecture that this one's files may lack


@dataclass(frozen=True)
class Placed:
    """A per-layer GGUF tensor (by its kind, e.g. `ffn_gate_exps`) that HuggingFace names or lays out
    otherwise: its HuggingFace name under `model.layers.N.` per suffix (weight / bias; `*` for every
    expert, stacked along the first dimension as Tessera holds them), its matrix transposed in the
    last two dimensions (`transposed`, weights only), and written into every `into[1]`-th entry of
    the last dimension from `into[0]` (one of the parts of an interleaved fused tensor)."""

    names: dict[str, str]
    transposed: bool = False
    into: tuple[int, int] | None = None
    # the stored values in the shape of their place (given the file's config.json fields), and that
    # place: a view of the HuggingFace tensor
    convert: Callable[[Any, dict[str, Any]], Any] | None = None
    select: Callable[[Any, dict[str, Any]], Any] | None = None
    # the stored rows in HuggingFace's order (an index; a reordering of whole rows, so quantized blocks
    # can be kept as they are): Qwen3.5's value heads
    rows: Callable[[dict[str, Any]], Any] | None = None


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
    sliding = _sliding(meta, n, 6)
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


def _sliding(meta: Metadata, n: int, default: int) -> list[bool]:
    """Which layers slide: `attention.sliding_window_pattern` as one flag per layer, or a period whose
    last layer is global (`default` where absent)."""
    pattern = meta.get("attention.sliding_window_pattern", default)
    if isinstance(pattern, list):  # one flag per layer: true where it slides
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
    else:
        sliding = []
    if len(sliding) != n:
        raise ConfigError(f"{str(meta.path)!r}: GGUF metadata {meta.arch}.attention.sliding_window_pattern is "
                          f"{pattern!r}; Tessera reads a period or one flag for each of the {n} layers")
    return sliding


def _biases(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    """The head size (`attention.key_length`) and which attention projections have biases (the file's tensors)."""
    return {"head_dim": meta.count("attention.key_length", d["hidden_size"] // d["num_attention_heads"]),
            "attention_bias": meta.tensor("blk.0.attn_q.bias") is not None,
            "attention_out_bias": meta.tensor("blk.0.attn_output.bias") is not None}


def _exaone4(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    out = {"head_dim": meta.count("attention.key_length", d["hidden_size"] // d["num_attention_heads"])}
    if "attention.sliding_window" in meta:  # hybrid: the sliding layers rotate, the full ones do not
        sliding = _sliding(meta, d["num_hidden_layers"], 4)
        out.update(sliding_window=meta.count("attention.sliding_window", 4096),
                   layer_types=["sliding_attention" if s else "full_attention" for s in sliding])
    return out


def _experts(meta: Metadata) -> dict[str, Any]:
    return {"num_experts_per_tok": meta.count("expert_used_count", 0),
            "moe_intermediate_size": meta.count("expert_feed_forward_length", 0)}


def _glm4moe(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    head_dim = meta.count("attention.key_length", d["hidden_size"] // d["num_attention_heads"])
    mtp = meta.get("nextn_predict_layers", 0)
    if not isinstance(mtp, int) or isinstance(mtp, bool) or not 0 <= mtp < d["num_hidden_layers"]:
        raise ConfigError(f"{str(meta.path)!r}: GGUF metadata glm4moe.nextn_predict_layers is {mtp!r}; Tessera reads "
                          "a count of the trailing blocks, below block_count")
    return {**_experts(meta), "head_dim": head_dim, "num_hidden_layers": d["num_hidden_layers"] - mtp,
            "partial_rotary_factor": meta.count("rope.dimension_count", head_dim) / head_dim,
            "attention_bias": meta.tensor("blk.0.attn_q.bias") is not None,
            "use_qk_norm": meta.tensor("blk.0.attn_q_norm") is not None,
            "n_routed_experts": meta.count("expert_count", 0), "n_shared_experts": meta.count("expert_shared_count", 1),
            "first_k_dense_replace": meta.get("leading_dense_block_count", 0),
            "routed_scaling_factor": float(meta.get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(meta.get("expert_weights_norm", True)),
            "n_group": meta.count("expert_group_count", 1), "topk_group": meta.count("expert_group_used_count", 1)}


def _gpt_oss(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    n, head_dim = d["num_hidden_layers"], d["hidden_size"] // d["num_attention_heads"]
    out = {**_experts(meta), "head_dim": meta.count("attention.key_length", head_dim),
           "num_local_experts": meta.count("expert_count", 0),
           "sliding_window": meta.count("attention.sliding_window", 128),
           "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
           "attention_bias": meta.tensor("blk.0.attn_q.bias") is not None}
    out["intermediate_size"] = out.pop("moe_intermediate_size")
    kind = meta.get("rope.scaling.type")
    if kind == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": float(meta.get("rope.scaling.factor", 1.0)),
                               "original_max_position_embeddings": meta.count("rope.scaling.original_context_length",
                                                                              4096),
                               "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    elif kind not in (None, "none"):
        raise ConfigError(f"{str(meta.path)!r}: GGUF metadata gpt-oss.rope.scaling.type is {kind!r}; gpt-oss files "
                          "have YaRN or none")
    return out


def _llama4(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    n, experts = d["num_hidden_layers"], meta.count("expert_count", 0)
    chunked = meta.get("attention.sliding_window", 8192) != 0
    return {"intermediate_size_mlp": d["intermediate_size"], "num_local_experts": experts,
            "intermediate_size": meta.count("expert_feed_forward_length", 0),
            "num_experts_per_tok": meta.count("expert_used_count", 1),
            "head_dim": meta.count("attention.key_length", d["hidden_size"] // d["num_attention_heads"]),
            "interleave_moe_layer_step": meta.count("interleave_moe_layer_step", 1),
            "attention_chunk_size": 8192 if chunked else None,
            "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n)], "use_qk_norm": experts != 128,
            "attn_temperature_tuning": True, "attn_scale": float(meta.get("attention.temperature_scale", 0.1)),
            "floor_scale": meta.count("attention.temperature_length", 8192)}


def _deltanet(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    """The Gated DeltaNet hybrid's fields (Qwen3-Next's and Qwen3.5's): sizes, layer period, partial rotary."""
    head_dim = meta.count("attention.key_length", d["hidden_size"] // d["num_attention_heads"])
    v_heads = meta.count("ssm.time_step_rank", 1)
    inner = meta.count("ssm.inner_size", v_heads)
    k_heads = meta.count("ssm.group_count", 1)
    if inner % v_heads or v_heads % k_heads:
        raise ConfigError(f"{str(meta.path)!r}: GGUF metadata {meta.arch}.ssm.inner_size ({inner}) is not a "
                          f"multiple of ssm.time_step_rank ({v_heads}), the value heads, or those of ssm.group_count "
                          f"({k_heads})")
    return {"head_dim": head_dim, "partial_rotary_factor": meta.count("rope.dimension_count", head_dim) / head_dim,
            "full_attention_interval": meta.count("full_attention_interval", 4),
            "linear_conv_kernel_dim": meta.count("ssm.conv_kernel", 4),
            "linear_key_head_dim": meta.count("ssm.state_size", 1),
            "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
            "linear_value_head_dim": inner // v_heads}


def _qwen3next(meta: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    return {**_experts(meta), **_deltanet(meta, d), "num_experts": meta.count("expert_count", 0),
            "shared_expert_intermediate_size": meta.count("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": bool(meta.get("expert_weights_norm", True))}


def _deltanet_sizes(d: dict[str, Any]) -> tuple[int, int, int]:
    """(key heads, q + k rows of a group, v rows of a group) of Qwen3-Next's in_proj_qkvz."""
    k_heads = d["linear_num_key_heads"]
    return k_heads, 2 * d["linear_key_head_dim"], d["linear_num_value_heads"] // k_heads * d["linear_value_head_dim"]


def _qkv_groups(values, d: dict[str, Any]):
    """attn_qkv's rows (every head's q, then k, then v) as [key heads, q + k + v of the head, in]."""
    k_heads, qk, v = _deltanet_sizes(d)
    q, k, rest = values.split([qk // 2 * k_heads, qk // 2 * k_heads, v * k_heads])
    return torch.cat([t.reshape(k_heads, -1, values.shape[-1]) for t in (q, k, rest)], dim=1)


def _a_log(a, d: dict[str, Any]):
    """HuggingFace's A_log from llama.cpp's A = -exp(A_log), which is negative."""
    if not bool((a < 0).all()):
        raise ValueError("llama.cpp stores A = -exp(A_log), negative; it holds values that are not")
    return torch.log(-a)


def _grouped(target, d: dict[str, Any]):
    k_heads = d["linear_num_key_heads"]
    return target.view(k_heads, -1, target.shape[-1])


def _qkv_rows(target, d: dict[str, Any]):
    _, qk, v = _deltanet_sizes(d)
    return _grouped(target, d)[:, :qk + v]


def _z_groups(values, d: dict[str, Any]):
    return values.reshape(d["linear_num_key_heads"], -1, values.shape[-1])


def _z_rows(target, d: dict[str, Any]):
    _, qk, v = _deltanet_sizes(d)
    return _grouped(target, d)[:, qk + v:]


def _untiled(values, d: dict[str, Any], dim: int, head: int):
    """Qwen3.5's value heads in HuggingFace's order (grouped by key head: k0's v0..v{r-1}, k1's ...) from
    the order llama.cpp's converter stores them in (tiled: every key head's v0, then every v1, ...),
    along `dim`, each head `head` entries wide."""
    k_heads = d["linear_num_key_heads"]
    per_k = d["linear_num_value_heads"] // k_heads
    dim %= values.dim()
    shape = values.shape
    tiled = values.reshape(*shape[:dim], per_k, k_heads, head, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def _v_rows(d: dict[str, Any], head: int, before: int = 0):
    """The stored rows of a value-head tensor (after `before` rows kept in place) in HuggingFace's order."""
    index = _untiled(torch.arange(d["linear_num_value_heads"] * head), d, 0, head)
    return torch.cat([torch.arange(before), before + index])


def _conv_untiled(w, d: dict[str, Any]):
    """The conv kernel [channels, width]: q and k channels as stored, v's value heads untiled; [channels, 1, width]."""
    qk = 2 * d["linear_num_key_heads"] * d["linear_key_head_dim"]
    return torch.cat([w[:qk], _untiled(w[qk:], d, 0, d["linear_value_head_dim"])]).unsqueeze(1)


def _exps(name: str) -> Placed:
    return Placed({"weight": f"mlp.experts.*.{name}.weight"})


_GLM4MOE_EXPERTS = {"ffn_gate_exps": _exps("gate_proj"), "ffn_up_exps": _exps("up_proj"),
                    "ffn_down_exps": _exps("down_proj"),
                    "exp_probs_b": Placed({"bias": "mlp.gate.e_score_correction_bias"})}
_QKVZ = {"weight": "linear_attn.in_proj_qkvz.weight"}
_QWEN3NEXT_PLACED = {**{k: v for k, v in _GLM4MOE_EXPERTS.items() if k != "exp_probs_b"},
                     "attn_qkv": Placed(_QKVZ, convert=_qkv_groups, select=_qkv_rows),
                     "attn_gate": Placed(_QKVZ, convert=_z_groups, select=_z_rows),
                     "ssm_a": Placed({"weight": "linear_attn.A_log"}, convert=_a_log),
                     "ssm_dt": Placed({"bias": "linear_attn.dt_bias"}),
                     "ssm_conv1d": Placed({"weight": "linear_attn.conv1d.weight"},
                                          convert=lambda w, d: w.unsqueeze(1))}
_LA = "linear_attn."
_QWEN35_PLACED = {
    "attn_qkv": Placed({"weight": _LA + "in_proj_qkv.weight"}, rows=lambda d: _v_rows(
        d, d["linear_value_head_dim"], 2 * d["linear_num_key_heads"] * d["linear_key_head_dim"])),
    "attn_gate": Placed({"weight": _LA + "in_proj_z.weight"}, rows=lambda d: _v_rows(d, d["linear_value_head_dim"])),
    "ssm_alpha": Placed({"weight": _LA + "in_proj_a.weight"}, rows=lambda d: _v_rows(d, 1)),
    "ssm_beta": Placed({"weight": _LA + "in_proj_b.weight"}, rows=lambda d: _v_rows(d, 1)),
    "ssm_out": Placed({"weight": _LA + "out_proj.weight"},
                      convert=lambda w, d: _untiled(w, d, 1, d["linear_value_head_dim"])),
    "ssm_a": Placed({"weight": _LA + "A_log"}, convert=lambda a, d: _untiled(_a_log(a, d), d, 0, 1)),
    "ssm_dt": Placed({"bias": _LA + "dt_bias"}, convert=lambda b, d: _untiled(b, d, 0, 1)),
    "ssm_conv1d": Placed({"weight": _LA + "conv1d.weight"}, convert=_conv_untiled)}
_PACKED_EXPERTS = (("gate", "gate_up_proj", 0), ("up", "gate_up_proj", 1), ("down", "down_proj", 0))
_QWEN35MOE_PLACED = {**_QWEN35_PLACED, **{f"ffn_{kind}_exps": Placed({"weight": f"mlp.experts.{hf}#{i}"})
                                          for kind, hf, i in _PACKED_EXPERTS}}
_GATE_UP = {"weight": "mlp.experts.gate_up_proj", "bias": "mlp.experts.gate_up_proj_bias"}
_GPT_OSS_PLACED = {"attn_sinks": Placed({"weight": "self_attn.sinks"}),
                   "ffn_gate_exps": Placed(_GATE_UP, transposed=True, into=(0, 2)),
                   "ffn_up_exps": Placed(_GATE_UP, transposed=True, into=(1, 2)),
                   "ffn_down_exps": Placed({"weight": "mlp.experts.down_proj", "bias": "mlp.experts.down_proj_bias"},
                                           transposed=True)}
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_LLAMA4_PLACED = {f"ffn_{kind}_exps": Placed({"weight": f"feed_forward.experts.{hf}#{i}"})
                  for kind, hf, i in (("gate", "gate_up_proj", 0), ("up", "gate_up_proj", 1), ("down", "down_proj", 0))}
_FF = tuple(f"feed_forward.{m}" for m in ("gate_proj", "up_proj", "down_proj", "router", "shared_expert.gate_proj",
                                           "shared_expert.up_proj", "shared_expert.down_proj"))

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", permuted=True, rope_freqs=True),
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
    "smollm3": Architecture("smollm3", permuted=True, rope_freqs=True),
    "exaone4": Architecture("exaone4", layer_modules=(
        "post_attention_layernorm", "post_feedforward_layernorm", *_QK_NORMS, *LLAMA_LAYER[2:]),
        reads=("attention.sliding_window",), config=_exaone4, rope_freqs=True),
    "glm4moe": Architecture("glm4_moe", layer_modules=LLAMA_LAYER + _QK_NORMS + (
        "mlp.gate", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"),
        reads=("expert_count",), config=_glm4moe, placed=_GLM4MOE_EXPERTS, extra_blocks=True),
    "gpt-oss": Architecture("gpt_oss", layer_modules=LLAMA_LAYER[:6] + ("mlp.router",), reads=(
        "expert_count", "attention.sliding_window", "rope.scaling.type", "rope.scaling.factor"),
        config=_gpt_oss, placed=_GPT_OSS_PLACED),
    "llama4": Architecture("llama4_text", layer_modules=LLAMA_LAYER[:6] + _FF, reads=(
        "expert_count", "attention.sliding_window"), config=_llama4, placed=_LLAMA4_PLACED, rope_freqs=True),
    "qwen3next": Architecture("qwen3_next", layer_modules=(
        "input_layernorm", "post_attention_layernorm", *LLAMA_LAYER[2:6], *_QK_NORMS, "linear_attn.in_proj_ba",
        "linear_attn.norm", "linear_attn.out_proj", "mlp.gate", "mlp.shared_expert_gate", "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"), reads=("expert_count",), config=_qwen3next,
        norm_offset=1.0, placed=_QWEN3NEXT_PLACED, unshifted=("ssm_norm",)),
    "qwen35": Architecture("qwen3_5_text", layer_modules=LLAMA_LAYER + _QK_NORMS + ("linear_attn.norm",),
                           config=_deltanet, norm_offset=1.0, placed=_QWEN35_PLACED, unshifted=("ssm_norm",)),
    "qwen35moe": Architecture("qwen3_5_moe_text", layer_modules=(
        *LLAMA_LAYER[:6], *_QK_NORMS, "linear_attn.norm", "mlp.gate", "mlp.shared_expert_gate",
        "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"),
        reads=("expert_count",), config=_qwen3next, norm_offset=1.0, placed=_QWEN35MOE_PLACED,
        unshifted=("ssm_norm",), optional=("feed_forward_length",)),
}
