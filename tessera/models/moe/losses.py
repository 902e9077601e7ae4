"""Load-balancing losses of the router. Each returns an unweighted fp32 scalar; the router
multiplies by its coefficient. T tokens, E experts, k experts per token.

Under data/sequence/context parallelism a micro-batch's tokens are spread over ranks. The losses
then take the micro-batch-wide `counts_E` (summed over ranks by an injected reducer) and
`num_tokens`; each rank's value covers its own tokens' probabilities, and the ranks' values add up
to the loss of the whole micro-batch (docs/architecture.md, "Numerics contract").
"""

from __future__ import annotations

import torch


def tokens_per_expert(indices_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the T*k routing slots chose each expert: [E] int64 (a scatter-add: `bincount`'s
    output size depends on the data, which costs a host synchronisation on GPUs)."""
    flat = indices_Tk.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int,
                        num_tokens: int | None = None) -> torch.Tensor:
    """Switch Transformer / GShard auxiliary loss (Fedus et al. 2021, eq. 4): E * sum_i f_i P_i,
    with f_i = count_i / (T k) the fraction of routing slots sent to expert i and
    P_i = sum_t p_{t,i} / T the mean router probability. Minimal (= 1) under uniform routing."""
    T = probs_TE.shape[0] if num_tokens is None else num_tokens
    E = probs_TE.shape[1]
    f = counts_E.float() / (T * top_k)
    P = probs_TE.float().sum(dim=0) / T
    return E * torch.sum(f * P)


def tokens_per_expert_per_sequence(indices_BSk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of each sequence's S*k routing slots chose each expert: [B, E] int64 (a
    scatter-add, like `tokens_per_expert`)."""
    B = indices_BSk.shape[0]
    return torch.zeros(B, num_experts, dtype=torch.int64, device=indices_BSk.device).scatter_add_(
        1, indices_BSk.reshape(B, -1), torch.ones_like(indices_BSk).reshape(B, -1))


def sequence_load_balancing_loss(probs_BSE: torch.Tensor, indices_BSk: torch.Tensor,
                                 counts_BE: torch.Tensor | None = None, seq_len: int | None = None) -> torch.Tensor:
    """DeepSeek-V2 sequence-wise balance loss (arXiv 2405.04434 eq. 24-25; DeepSeek-V3 eq. 17-20):
    the Switch loss computed within each sequence, then averaged over the batch's sequences.

    When context parallelism spreads each sequence over ranks, `counts_BE` (each whole sequence's
    routing counts) and `seq_len` (its whole length) come from the router's count reducer; this
    rank's P then covers its own tokens (sum / seq_len), and the ranks' values add up to the loss."""
    B, S, E = probs_BSE.shape
    k = indices_BSk.shape[-1]
    seq_len = S if seq_len is None else seq_len
    if counts_BE is None:
        one_hot = torch.zeros(B, S * k, E, device=probs_BSE.device)
        one_hot.scatter_(2, indices_BSk.reshape(B, S * k, 1), 1.0)
        counts = one_hot.sum(dim=1)
    else:
        counts = counts_BE.float()
    f = counts / (seq_len * k)  # [B, E]
    P = probs_BSE.float().mean(dim=1)  # [B, E]
    if seq_len != S:
        P = P * (S / seq_len)  # this rank's S tokens' share of the whole sequence's mean
    return (E * (f * P).sum(dim=-1)).mean()


def router_z_loss(logits_TE: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2,
    which keeps the router's logits small and its softmax numerically stable."""
    T = logits_TE.shape[0] if num_tokens is None else num_tokens
    return torch.logsumexp(logits_TE.float(), dim=-1).square().sum() / T
