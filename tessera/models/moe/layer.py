"""The MoE block: route, dispatch to the experts, combine, add the shared experts.

    y = sum_{e in topk(x)} g_e(x) * Expert_e(x)  [+ sigmoid(x w_s) *] SharedExperts(x)

or, with `gate_input` (Llama 4, one expert per token), Expert_e(g_e(x) * x) + SharedExperts(x).

Shared experts (DeepSeekMoE, Dai et al. 2024) see every token; Qwen2-MoE scales their output by
a learned sigmoid gate. Model code stays single-device: communication, if any, hides behind the
seams that parallel code injects: `self.dispatcher` (dispatcher.py), `self.keep_mask`
(capacity.py), `self.router.reduce_counts` (router.py) and `self.experts.local_weight`
(experts.py). B batch, S sequence, T = B*S tokens, D model dim.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.config.model import MoEConfig
from tessera.models.mlp import FeedForward, feed_forward
from tessera.models.moe.biased_experts import BiasedExperts
from tessera.models.moe.capacity import KeepMask, expert_capacity, local_keep_mask
from tessera.models.moe.dispatcher import LocalDispatcher, TokenDispatcher
from tessera.models.moe.experts import GroupedExperts, Relu2Experts
from tessera.models.moe.router import Router, RouterOutput


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(dim, cfg)
        self.experts = _experts(dim, cfg)
        relu2 = cfg.expert_activation == "relu2"  # Nemotron-H: its shared expert is an ungated relu^2 MLP too
        self.shared_experts = (None if cfg.shared_ffn_dim == 0 else
                               feed_forward(dim, cfg.shared_ffn_dim, "relu2") if relu2 else
                               FeedForward(dim, cfg.shared_ffn_dim))
        self.shared_gate = nn.Linear(dim, 1, bias=False) if cfg.shared_expert_gate else None
        self.dispatcher: TokenDispatcher = LocalDispatcher(cfg.num_experts, cfg.pad_to_capacity)
        self.keep_mask: KeepMask = local_keep_mask

    def capacity(self, route: RouterOutput) -> int:
        return expert_capacity(route.num_tokens, self.cfg.num_experts, self.cfg.top_k, self.cfg.capacity_factor)

    def capacity_mask(self, route: RouterOutput, batch_shape: tuple[int, int]
                      ) -> tuple[torch.Tensor | None, int | None]:
        """(keep [T, k], capacity) in training with a capacity factor; (None, None) when dropless.
        Inference is always dropless, so a request's output never depends on its batch-mates."""
        if self.cfg.capacity_factor is None or not self.training:
            return None, None
        cap = self.capacity(route)
        return self.keep_mask(route.indices_Tk, route.weights_Tk, batch_shape, self.cfg.num_experts, cap,
                              self.cfg.drop_policy), cap

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        route = self.router(x_TD, (B, S))
        keep, cap = self.capacity_mask(route, (B, S))
        x_in, gates_Tk = x_TD, route.weights_Tk
        if self.cfg.gate_input:  # Llama 4: the one gate scales the token going in; the outputs add as they are
            x_in, gates_Tk = (x_TD.float() * gates_Tk).to(x_TD.dtype), torch.ones_like(gates_Tk)
        rows, tokens_per_expert, ctx = self.dispatcher.dispatch(x_in, route.indices_Tk, keep, cap)
        out_TD = self.dispatcher.combine(self.experts(rows, tokens_per_expert), gates_Tk, ctx)
        if self.shared_experts is not None:
            shared = self.shared_experts(x_TD)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_TD)) * shared
            out_TD = out_TD + shared
        return out_TD.view(B, S, D), route


def _experts(dim: int, cfg: MoEConfig) -> nn.Module:
    """The routed experts of `cfg.expert_activation`: SwiGLU, gpt-oss's biased clamped SwiGLU, or relu^2."""
    if cfg.expert_activation == "swiglu":
        return GroupedExperts(cfg.num_experts, dim, cfg.ffn_dim, cfg.grouped_gemm)
    if cfg.expert_activation == "relu2":
        return Relu2Experts(cfg.num_experts, dim, cfg.ffn_dim, cfg.grouped_gemm)
    return BiasedExperts(cfg.num_experts, dim, cfg.ffn_dim, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.grouped_gemm)
