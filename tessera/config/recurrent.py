"""The recurrent layers' sections of a model config (`ModelConfig.linear_attention`, `ModelConfig.mamba`):
which layers of a hybrid decoder keep a per-sequence state instead of keys and values, and their shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet layers of a hybrid decoder (Qwen3-Next; tessera/models/linear_attention): the
    layers that run it instead of softmax attention, and its shapes. Each key head serves
    n_value_heads / n_key_heads value heads. `kind` "kda": Kimi delta attention instead (a decay per
    key channel; as many value heads as key heads, of the same size)."""

    layers: list[int] = field(default_factory=list)  # layer indices whose mixer is Gated DeltaNet
    n_key_heads: int = 16
    n_value_heads: int = 32
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_width: int = 4  # taps of the short causal convolution on q, k, v
    chunk_size: int = 64  # tokens per chunk of the chunked (training and prompt) form; not in config.json
    # how the input projections are laid out: "grouped" (Qwen3-Next: in_proj_qkvz and in_proj_ba, per
    # key-head group) or "split" (Qwen3.5: in_proj_qkv as [q | k | v], in_proj_z, in_proj_b, in_proj_a); the family's
    projections: str = "grouped"
    kind: str = "gated_deltanet"  # or "kda" (Kimi Linear: tessera/models/linear_attention/kimi_delta_attention.py)


@dataclass
class Mamba2Config:
    """Mamba-2 (SSD) mixers of a hybrid decoder (Nemotron-H; tessera/models/linear_attention/mamba2.py)
    on the layers `ModelConfig.layer_types` marks "mamba": their heads and state. n_groups groups of
    n_heads / n_groups consecutive heads share one pair of input-dependent B, C maps."""

    n_heads: int = 128
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 8
    conv_width: int = 4  # taps of the short causal convolution on x, B, C
    conv_bias: bool = True
    proj_bias: bool = False  # biases on in_proj and out_proj
    dt_min: float = 0.001  # the step size's lower clamp (transformers' time_step_limit)
    chunk_size: int = 128  # tokens per chunk of the chunked (training and prompt) form
