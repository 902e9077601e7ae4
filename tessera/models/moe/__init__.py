"""Mixture-of-Experts: router, balancing losses, capacity, grouped experts, dispatcher seam."""

from tessera.models.moe.capacity import capacity_keep_mask, expert_capacity
from tessera.models.moe.dispatcher import DispatchContext, LocalDispatcher, TokenDispatcher
from tessera.models.moe.experts import GroupedExperts, grouped_linear
from tessera.models.moe.layer import MoE
from tessera.models.moe.losses import (
    load_balancing_loss,
    router_z_loss,
    sequence_load_balancing_loss,
    tokens_per_expert,
)
from tessera.models.moe.router import Router, RouterOutput, update_expert_bias
from tessera.models.moe.scores import balancing_probs, group_limited_topk, router_scores, topk_gates
from tessera.models.moe.sinkhorn import sinkhorn

__all__ = [
    "DispatchContext", "GroupedExperts", "LocalDispatcher", "MoE", "Router", "RouterOutput", "TokenDispatcher",
    "balancing_probs", "capacity_keep_mask", "expert_capacity", "group_limited_topk", "grouped_linear",
    "load_balancing_loss", "router_scores", "router_z_loss", "sequence_load_balancing_loss", "sinkhorn",
    "tokens_per_expert", "topk_gates", "update_expert_bias",
]
