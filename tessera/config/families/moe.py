"""What the Mixture-of-Experts families share: the routed-expert block's HuggingFace names, the
router's auxiliary-loss convention, and the routing an export refuses unless the class has it.

A family gives `moe_block` (the block's module name), `expert_projections` (the experts' weight
names) and `shared_expert` (the shared experts' module name) where they differ from the defaults,
and maps its own config.json fields in a subclass: `moe_from_hf` / `moe_to_hf`, and
`moe_requirements`, the routing settings its class fixes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.base import MLP, Family


def aux_coef_from_hf(coef: float, top_k: int, n_layers: int) -> float:
    """HF's router_aux_loss_coef multiplies one loss over all layers' tokens pooled, with f_i as the
    fraction of tokens (not slots): about k / L times Tessera's per-layer losses summed (Megatron's
    convention). The same push on the router needs coef * k / L here."""
    return coef * top_k / n_layers


def aux_coef_to_hf(coef: float, top_k: int, n_layers: int) -> float:
    return coef * n_layers / top_k


@dataclass(frozen=True)
class MoEFamily(Family):
    """A family with routed experts (model.moe); dense layers, where it has them, are `Family`'s MLP."""

    moe_block: str = "mlp"  # model.layers.{i}.<moe_block>.gate / .experts.{j} / .<shared_expert>
    expert_projections: Mapping[str, str] = field(default_factory=lambda: MLP)  # w1/w2/w3 -> the experts' names
    shared_expert: str = "shared_experts"
    moe: ClassVar[bool] = True

    def config_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        return super().config_from_hf(d) | {"moe": self.moe_from_hf(d)}

    def moe_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        """The `MoEConfig` fields from the family's own config.json fields."""
        raise NotImplementedError(f"{type(self).__name__} maps no expert fields")

    def config_to_hf(self, cfg) -> dict[str, Any]:
        d = super().config_to_hf(cfg)
        self.moe_to_hf(cfg, d)
        return d

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        """Add the expert fields to config.json `d`, after the attention's."""
        raise NotImplementedError(f"{type(self).__name__} maps no expert fields")

    def ffn_names(self, cfg, i: int) -> dict[str, list[str]]:
        if not cfg.is_moe_layer(i):
            return super().ffn_names(cfg, i)
        e, block, out = cfg.moe, f"model.layers.{i}.{self.moe_block}", {}
        out[f"layers.{i}.moe.router.weight"] = [f"{block}.gate.weight"]
        if e.expert_bias:
            out[f"layers.{i}.moe.router.expert_bias"] = [f"{block}.gate.e_score_correction_bias"]
        for n, h in self.expert_projections.items():
            out[f"layers.{i}.moe.experts.{n}"] = [f"{block}.experts.{j}.{h}.weight" for j in range(e.num_experts)]
        if e.shared_ffn_dim:
            for n, h in MLP.items():
                out[f"layers.{i}.moe.shared_experts.{n}.weight"] = [f"{block}.{self.shared_expert}.{h}.weight"]
        if e.shared_expert_gate:
            out[f"layers.{i}.moe.shared_gate.weight"] = [f"{block}.shared_expert_gate.weight"]
        return out

    def moe_requirements(self, e) -> dict[str, Any]:
        """model.moe field -> the value this family's HuggingFace class fixes, in the order checked:
        by default softmax top-k routing over all experts, unscaled, ungrouped, without a routing
        bias, in every layer."""
        return {"score_func": "softmax", "softmax_before_topk": True, "scaling_factor": 1.0, "n_groups": 1,
                "expert_bias": False, "first_k_dense": 0, "layer_freq": 1}

    def check_exportable(self, cfg) -> None:
        e = cfg.moe
        for key, value in self.moe_requirements(e).items():
            if getattr(e, key) != value:
                raise ModelError(f"model.moe.{key}={getattr(e, key)!r} cannot be exported as {self.name} "
                                 f"(its HuggingFace class needs {value!r})")
