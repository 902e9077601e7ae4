"""What each recurrent mixer keeps per sequence, declared beside the mixers so that the serving
engine's state slots (tessera/infer/scheduling/recurrent_state.py) hold any of them without knowing
which: `state_layouts(cfg)` maps every layer whose mixer keeps a recurrent state to its `StateLayout`,
the state's class and, per field, its shape for one sequence and whether it is kept in fp32 (else in
the engine's dtype). Gated DeltaNet keeps its convolution window and delta state, Mamba-2 its
convolution window and SSD state. A new recurrent mixer adds its layout here.

Under tensor parallelism (`tp` > 1) each rank runs 1/tp of a mixer's heads, and the key-head groups or
Mamba groups they read (tessera/parallel/tensor_parallel.py's `DeltaNetRankPart`, `KdaRankPart`,
`MambaRankPart`), so its state is 1/tp of every field's channels or heads: the layouts a rank's
slots hold. The serving layout check (`ParallelDims.validate`) has made sure tp divides them."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.models.linear_attention.gated_deltanet import DeltaNetState
from tessera.models.linear_attention.mamba2 import Mamba2State


@dataclass(frozen=True)
class StateField:
    name: str  # the state class's field
    shape: tuple[int, ...]  # one sequence's
    fp32: bool  # kept in fp32 whatever the engine's dtype (the recurrences' states)


@dataclass(frozen=True)
class StateLayout:
    kind: type  # the state class its mixer's `mix` takes and returns (fields below, and `tokens`)
    fields: tuple[StateField, ...]

    def elements(self) -> tuple[int, int]:
        """(elements in the engine's dtype, fp32 elements) of one sequence's state."""
        sizes = [(f.fp32, _numel(f.shape)) for f in self.fields]
        return sum(n for fp32, n in sizes if not fp32), sum(n for fp32, n in sizes if fp32)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def deltanet_layout(cfg: ModelConfig, tp: int = 1) -> StateLayout:
    """Gated DeltaNet's (and Kimi delta attention's) state on one of `tp` ranks."""
    la = cfg.linear_attention
    keys, values = la.n_key_heads // tp, la.n_value_heads // tp
    channels = 2 * keys * la.key_head_dim + values * la.value_head_dim
    return StateLayout(DeltaNetState, (StateField("conv", (channels, la.conv_width - 1), False),
                                       StateField("delta", (values, la.key_head_dim, la.value_head_dim), True)))


def mamba2_layout(cfg: ModelConfig, tp: int = 1) -> StateLayout:
    """Mamba-2's state on one of `tp` ranks (heads split with their groups)."""
    m = cfg.mamba
    heads, groups = m.n_heads // tp, m.n_groups // tp
    channels = heads * m.head_dim + 2 * groups * m.state_size
    return StateLayout(Mamba2State, (StateField("conv", (channels, m.conv_width - 1), False),
                                     StateField("ssm", (heads, m.head_dim, m.state_size), True)))


def chunk_tokens(cfg: ModelConfig) -> int:
    """The chunk the chunked form of the model's recurrent layers works in (Gated DeltaNet's and Kimi
    delta attention's `model.linear_attention.chunk_size`, Mamba-2's `model.mamba.chunk_size`; the
    larger where a model had both), 0 for a model without such layers: where the prefix cache's
    snapshots fall by default (infer/scheduling/state_snapshots.py)."""
    sections = (cfg.linear_attention, cfg.mamba)
    return max((s.chunk_size for s in sections if s is not None), default=0)


def state_layouts(cfg: ModelConfig, tp: int = 1) -> dict[int, StateLayout]:
    """Layer -> the layout of its recurrent state on one of `tp` tensor-parallel ranks, for every layer
    that keeps one (none: no such layer)."""
    out = {}
    for i in range(cfg.n_layers):
        if cfg.is_linear_attention_layer(i):
            out[i] = deltanet_layout(cfg, tp)
        elif cfg.is_mamba_layer(i):
            out[i] = mamba2_layout(cfg, tp)
    return out
