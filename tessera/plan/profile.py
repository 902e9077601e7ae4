"""What the estimators need from a model, computed once and reused across layouts.

Every decoder layer is dense or MoE, and its token mixer (`layer_mixer`: softmax attention, the
delta rule, SSD or none) sets what context parallelism exchanges for it (comm.py). Layers alike in
both (and, in a one-sublayer model, in their sublayer) hold the same parameters and keep the same
activations: `layer_kind`, each kind's first layer standing for it (`stage_layer_kinds`), so a
hybrid model's recurrent layers are sized as themselves, not as its attention layers. A
`ModelProfile` records each layer's kind and memoises per-kind results, so planning one layout is
O(pipeline stages) and a search over tens of thousands of layouts takes seconds. It is an explicit object
handed to the functions that use it, never global.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.config.layout_rules import cp_layout
from tessera.config.model import ModelConfig
from tessera.models.counting import count_params
from tessera.models.flops import (
    attention_core_flops_per_token,
    head_forward_flops_per_token,
    layer_forward_flops_per_token,
)
from tessera.plan.layout import Layout, stage_layers


@dataclass
class ModelProfile:
    cfg: ModelConfig
    seq_len: int
    moe: list[bool]  # kind of each layer
    layer_flops: dict[bool, float]  # forward FLOPs per token of a layer of each kind
    core_flops: float  # forward FLOPs per token of one attention core
    head_flops: float  # forward FLOPs per token of the LM head
    params_total: int
    params_active: int
    mixers: list[str] = field(default_factory=list)  # each layer's `layer_mixer`
    kinds: list[int] = field(default_factory=list)  # each layer's `layer_kind`: the first layer of its kind
    _memo: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, cfg: ModelConfig, seq_len: int) -> ModelProfile:
        moe = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
        flops = {}
        for kind in set(moe):
            flops[kind] = layer_forward_flops_per_token(cfg, moe.index(kind), seq_len)
        return cls(cfg=cfg, seq_len=seq_len, moe=moe, layer_flops=flops,
                   core_flops=attention_core_flops_per_token(cfg, seq_len),
                   head_flops=head_forward_flops_per_token(cfg), params_total=count_params(cfg),
                   params_active=count_params(cfg, active=True),
                   mixers=[layer_mixer(cfg, i) for i in range(cfg.n_layers)], kinds=layer_kinds(cfg))

    def representative(self, moe: bool) -> int:
        """Index of the first layer of that kind."""
        return self.moe.index(moe)

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def stages(self, pp: int, vpp: int) -> list[list[int]]:
        return self.memo(("stages", pp, vpp), lambda: stage_layers(self.cfg.n_layers, pp, vpp))

    def _stage_counts(self, by: str, of: Sequence[Hashable], pp: int, vpp: int, stage: int, recompute: str,
                      interval: int) -> dict[tuple[Any, bool], int]:
        """Layers of `stage` counted by (`of[i]`, does the recomputation policy apply to layer i): a policy
        other than none applies to every `interval`-th layer (layer id % interval == 0); memoised under `by`."""
        def count() -> dict[tuple[Any, bool], int]:
            out: dict[tuple[Any, bool], int] = {}
            for i in self.stages(pp, vpp)[stage]:
                key = (of[i], recompute != "none" and i % interval == 0)
                out[key] = out.get(key, 0) + 1
            return out

        return self.memo((by, pp, vpp, stage, recompute, interval), count)

    def stage_kinds(self, pp: int, vpp: int, stage: int, recompute: str, interval: int) -> dict[tuple[bool, bool], int]:
        """Layers of `stage` counted by (is MoE, does the recomputation policy apply to it)."""
        return self._stage_counts("kinds", self.moe, pp, vpp, stage, recompute, interval)

    def stage_layer_kinds(self, pp: int, vpp: int, stage: int, recompute: str, interval: int
                          ) -> dict[tuple[int, bool], int]:
        """Layers of `stage` counted by (the first layer of their `layer_kind`, does the recomputation
        policy apply to it)."""
        return self._stage_counts("layer_kinds", self.kinds, pp, vpp, stage, recompute, interval)

    def stage_mixers(self, pp: int, vpp: int, stage: int, recompute: str, interval: int) -> dict[tuple[str, bool], int]:
        """Layers of `stage` counted by (`layer_mixer`, does the recomputation policy apply to it)."""
        return self._stage_counts("mixers", self.mixers, pp, vpp, stage, recompute, interval)


def layer_mixer(cfg: ModelConfig, i: int) -> str:
    """Layer i's token mixer: "attention" (softmax or latent attention, a key/value cache), "delta" (Gated
    DeltaNet or Kimi delta attention: the gated delta rule), "ssd" (Mamba-2) or "none" (an MLP-only layer)."""
    if cfg.is_linear_attention_layer(i):
        return "delta"
    if cfg.is_mamba_layer(i):
        return "ssd"
    return "attention" if cfg.has_attention(i) else "none"


def layer_kind(cfg: ModelConfig, i: int) -> tuple[bool, str, str | None]:
    """What sets layer i's parameters and saved activations: MoE or not, its mixer, its one sublayer (Nemotron-H)."""
    return cfg.is_moe_layer(i), layer_mixer(cfg, i), None if cfg.sublayers is None else cfg.sublayers[i]


def layer_kinds(cfg: ModelConfig) -> list[int]:
    """Each layer's kind, named by the first layer of that kind."""
    first: dict[tuple[bool, str, str | None], int] = {}
    return [first.setdefault(layer_kind(cfg, i), i) for i in range(cfg.n_layers)]


def handoff_buffers(cfg: ModelConfig, mixer: str, lay: Layout, micro_batch: int,
                    compute_bytes: float) -> dict[str, float]:
    """The bytes of each buffer a recurrent layer's state handoff all-gathers over cp, whole (every cp
    rank's rows; tessera.parallel.context_parallel_recurrent), for `micro_batch` sequences: the
    convolution's last W-1 inputs of this rank's channels (in the compute dtype), and each part's
    transition and zero-start end state over this rank's heads (fp32). `mixer`: "delta" or "ssd"."""
    rows = lay.cp * micro_batch * (1 if cp_layout(lay.cp_method) == "contiguous" else 2)
    if mixer == "delta":
        la = cfg.linear_attention
        kda = la.kind == "kda"  # Kimi delta attention: value heads are the key heads, of the key dim
        heads, K = (la.n_value_heads if not kda else la.n_key_heads) // lay.tp, la.key_head_dim
        V = K if kda else la.value_head_dim
        channels = 2 * la.n_key_heads // lay.tp * K + heads * V
        width, transition, end = la.conv_width, heads * K * K, heads * K * V
    else:
        m = cfg.mamba
        heads = m.n_heads // lay.tp
        channels = heads * m.head_dim + 2 * (m.n_groups * heads // m.n_heads) * m.state_size
        width, transition, end = m.conv_width, heads, heads * m.head_dim * m.state_size
    return {"convolution inputs": rows * channels * (width - 1) * compute_bytes,
            "transitions": rows * transition * 4.0, "end states": rows * end * 4.0}


def handoff_flops(cfg: ModelConfig, mixer: str, lay: Layout, micro_batch: int, seq_len: int) -> float:
    """Forward FLOPs one rank's recurrent layer adds under context parallelism, per micro-batch of
    `micro_batch` sequences (tessera.models.linear_attention.handoff): the delta rule runs over V + K
    value columns instead of V (its 6 K V per head and token counted again for the K more) and each
    token's output adds its start state's share (2 K V per head); SSD adds 2 P N per head and token;
    the scan of earlier parts applies up to cp transitions per sequence (2 cp under the zig-zag split:
    rank 0 holds the first part and the last), and each part's own once more, to a state."""
    tokens = micro_batch * seq_len / lay.cp
    parts = 1 if cp_layout(lay.cp_method) == "contiguous" else 2
    steps = micro_batch * (lay.cp * parts + parts)
    if mixer == "delta":
        la = cfg.linear_attention
        kda = la.kind == "kda"
        heads, K = (la.n_key_heads if kda else la.n_value_heads) // lay.tp, la.key_head_dim
        V = K if kda else la.value_head_dim
        return tokens * heads * (6 * K * K + 2 * K * V) + steps * 2 * heads * K * K * V
    m = cfg.mamba
    heads = m.n_heads // lay.tp
    return tokens * heads * 2 * m.head_dim * m.state_size + steps * 2 * heads * m.head_dim * m.state_size
