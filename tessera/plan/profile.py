"""What the estimators need from a model, computed once and reused across layouts.

Every decoder layer is one of two kinds, dense or MoE, and layers of a kind cost the same FLOPs,
parameters and activations. A `ModelProfile` records each layer's kind and memoises per-kind
results, so planning one layout is O(pipeline stages) and a search over tens of thousands of
layouts takes seconds. It is an explicit object handed to the functions that use it, never global.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from tessera.config.model import ModelConfig
from tessera.models.counting import count_params
from tessera.models.flops import (
    attention_core_flops_per_token,
    head_forward_flops_per_token,
    layer_forward_flops_per_token,
)
from tessera.plan.layout import stage_layers


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
                   params_active=count_params(cfg, active=True))

    def representative(self, moe: bool) -> int:
        """Index of the first layer of that kind."""
        return self.moe.index(moe)

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def stages(self, pp: int, vpp: int) -> list[list[int]]:
        return self.memo(("stages", pp, vpp), lambda: stage_layers(self.cfg.n_layers, pp, vpp))

    def stage_kinds(self, pp: int, vpp: int, stage: int, recompute: str, interval: int) -> dict[tuple[bool, bool], int]:
        """Layers of `stage` counted by (is MoE, does the recomputation policy apply to it): a policy
        other than none applies to every `interval`-th layer (layer id % interval == 0)."""
        def count() -> dict[tuple[bool, bool], int]:
            out: dict[tuple[bool, bool], int] = {}
            for i in self.stages(pp, vpp)[stage]:
                key = (self.moe[i], recompute != "none" and i % interval == 0)
                out[key] = out.get(key, 0) + 1
            return out

        return self.memo(("kinds", pp, vpp, stage, recompute, interval), count)
