"""The MoE router: fp32 logits, expert choice and gate weights, balancing losses and token counts.

Everything the router learns about balance comes back explicitly in `RouterOutput`; nothing is
kept in global state. Expert-bias balancing keeps its bias as a buffer (saved with the model) and
changes it only through `update_bias`, which the trainer calls after each optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.config.model import MoEConfig
from tessera.models.moe.losses import (
    load_balancing_loss,
    router_z_loss,
    sequence_load_balancing_loss,
    tokens_per_expert,
    tokens_per_expert_per_sequence,
)
from tessera.models.moe.scores import balancing_probs, topk_gates
from tessera.models.moe.sinkhorn import TokenReducer, sinkhorn

# (local counts [E], local token count) -> (micro-batch counts [E], micro-batch token count).
CountReducer = Callable[[torch.Tensor, int], tuple[torch.Tensor, int]]


def no_reduction(counts_E: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, int]:
    return counts_E, num_tokens


@dataclass
class RouterOutput:
    indices_Tk: torch.Tensor  # chosen experts
    weights_Tk: torch.Tensor  # gate weights, fp32
    counts_E: torch.Tensor  # routing slots per expert over the micro-batch (before capacity drops)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # weighted by their coefficients
    num_tokens: int = 0  # tokens of the whole micro-batch (a Python int: capacity needs no host sync)


# A pytree node, so that code walking a module's outputs finds the tensors inside: FSDP2 (torch 2.11)
# hooks the unsharding of a router that is its own FSDP unit (bf16 layouts) onto its output tensors;
# without this it saw none, and backward ran with the router's weight already freed.
torch.export.register_dataclass(RouterOutput, serialized_type_name="tessera.RouterOutput")


def update_expert_bias(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (Wang et al. 2024, arXiv 2408.15664; DeepSeek-V3 section 2.1.2):
    raise the bias of under-loaded experts and lower it for over-loaded ones by a fixed step."""
    counts = counts_E.float()
    bias_E.add_(rate * torch.sign(counts.mean() - counts))


class Router(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, dim))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.router_bias else None  # gpt-oss
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # Seams for a micro-batch whose tokens are spread over ranks (context parallelism): `reduce_counts`
        # sums routing counts (per expert, and per sequence and expert for the sequence-level loss) and
        # token counts over them; `reduce_over_tokens` does Sinkhorn's column sums and maxima.
        self.reduce_counts: CountReducer = no_reduction
        self.reduce_over_tokens: TokenReducer | None = None

    def forward(self, x_TD: torch.Tensor, batch_shape: tuple[int, int]) -> RouterOutput:
        cfg = self.cfg
        if self.training and cfg.jitter_eps > 0:  # Switch Transformer: multiplicative noise on the router input
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1 - cfg.jitter_eps, 1 + cfg.jitter_eps)
        with torch.autocast(x_TD.device.type, enabled=False):  # [T, E] in fp32 whatever the model dtype
            logits = x_TD.float() @ self.weight.float().T
            if self.bias is not None:
                logits = logits + self.bias.float()
        choice = (sinkhorn(logits, cfg.sinkhorn_iters, reduce=self.reduce_over_tokens)
                  if (cfg.sinkhorn and self.training) else None)
        idx, weights = topk_gates(
            logits, k=cfg.top_k, score_func=cfg.score_func, softmax_before_topk=cfg.softmax_before_topk,
            norm_topk_prob=cfg.norm_topk_prob, scaling_factor=cfg.scaling_factor, n_groups=cfg.n_groups,
            topk_groups=cfg.topk_groups, expert_bias_E=self.expert_bias, choice_TE=choice)
        counts, num_tokens = self.reduce_counts(tokens_per_expert(idx, cfg.num_experts), idx.shape[0])
        losses: dict[str, torch.Tensor] = {}
        if cfg.aux_loss_coef > 0 or cfg.seq_aux_loss_coef > 0:
            probs = balancing_probs(logits, cfg.score_func)
            if cfg.aux_loss_coef > 0:
                losses["load_balancing"] = cfg.aux_loss_coef * load_balancing_loss(
                    probs, counts, cfg.top_k, num_tokens)
            if cfg.seq_aux_loss_coef > 0:
                B, S = batch_shape
                idx_BSk = idx.view(B, S, -1)
                seq_counts, seq_len = self.reduce_counts(
                    tokens_per_expert_per_sequence(idx_BSk, cfg.num_experts).flatten(), S)
                losses["seq_load_balancing"] = cfg.seq_aux_loss_coef * sequence_load_balancing_loss(
                    probs.view(B, S, -1), idx_BSk, seq_counts.view(B, -1), seq_len)
        if cfg.z_loss_coef > 0:
            losses["z_loss"] = cfg.z_loss_coef * router_z_loss(logits, num_tokens)
        return RouterOutput(idx, weights, counts.detach(), losses, num_tokens)

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor) -> None:
        if self.expert_bias is not None:
            update_expert_bias(self.expert_bias, counts_E.to(self.expert_bias.device), self.cfg.bias_update_rate)
