"""The units the planner's activation counts are made of: a saved storage per token (and the set of them a
layer's mirrored forward keeps, each storage once), and the facts about routed experts and the attention
kernel that both the mirror of the model's saved tensors (activation_terms.py) and the operator-level
recomputation terms (recompute_terms.py) need."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.plan.activation_dtypes import ActivationDtype


@dataclass(frozen=True)
class SavedTensor:
    """One saved storage: `per_token` elements per token plus `fixed` elements per micro-batch."""

    name: str
    per_token: float
    itemsize: int
    split: str = "seq"
    fixed: float = 0.0

    def nbytes(self, tokens: float, tp: int = 1, sp: bool = False) -> float:
        div = tp if self.split == "tp" or (self.split == "seq" and sp) else 1
        return (self.per_token * tokens + self.fixed) * self.itemsize / div


@dataclass(frozen=True)
class Storage:
    """A storage flowing through the mirrored forward: key (identity), elements per token (plus
    `fixed` per micro-batch), bytes per element."""

    key: str
    per_token: float
    itemsize: int
    split: str
    fixed: float = 0.0


class SavedSet:
    """Saved storages keyed by identity, so a storage saved by several ops counts once."""

    def __init__(self) -> None:
        self.items: dict[str, SavedTensor] = {}

    def keep(self, t: Storage) -> None:
        if t.key not in self.items:
            self.items[t.key] = SavedTensor(t.key, t.per_token, t.itemsize, t.split, t.fixed)

    def new(self, key: str, per_token: float, itemsize: int, split: str, fixed: float = 0.0) -> Storage:
        t = Storage(key, per_token, itemsize, split, fixed)
        if key not in self.items:
            self.items[key] = SavedTensor(key, per_token, itemsize, split, fixed)
        return t


def expert_rows(cfg: ModelConfig, tokens: int) -> float:
    """Rows the experts compute, per token. The local dispatcher's shapes never depend on the
    routing: every one of the k routing slots of a token is a row (a slot dropped by the capacity
    is a masked zero row after the last expert's), so this is k, or E x capacity / T when padding
    to capacity, whether or not slots are dropped."""
    e = cfg.moe
    if e.capacity_factor is None or not e.pad_to_capacity:
        return float(e.top_k)
    return e.num_experts * math.ceil(tokens * e.top_k / e.num_experts * e.capacity_factor) / tokens


def grouped_experts_apply(cfg: ModelConfig, dt: ActivationDtype) -> bool:
    """Whether the routed experts run as one grouped GEMM per weight (models/moe/experts.py: rows of
    16-byte multiples in the compute dtype) rather than one product per expert."""
    e = cfg.moe
    return e.grouped_gemm and (cfg.dim * dt.compute) % 16 == 0 and (e.ffn_dim * dt.compute) % 16 == 0


def sdpa_core(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer `layer`'s attention core is an SDPA kernel, whose outputs `recompute=op` keeps where its
    save list names attention_core: a layer with attention and without sinks. gpt-oss's core with sinks is an
    explicit fp32 softmax (models/attention_variants/attention_sinks.py): products inside the core, which re-runs
    whatever the save list (tessera/parallel/memory/recompute_policy.py)."""
    return cfg.has_attention(layer) and not cfg.attention_sinks


DEVICES = ("cuda", "cpu")


def math_attention(cfg: ModelConfig, device: str) -> bool:
    """Whether the model's attention cores run through SDPA's math kernel rather than a fused one: on the
    CPU where the value head size differs from the query/key one (MLA: v_head_dim against the nope and rope
    parts; torch's CPU flash kernel takes only equal sizes). CUDA's memory-efficient kernel takes them."""
    if device not in DEVICES:
        raise ConfigError(f"device={device!r} is invalid: one of {', '.join(DEVICES)}")
    m = cfg.mla
    return device == "cpu" and m is not None and m.v_head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim
