"""Sinkhorn routing (S-BASE; Clark et al. 2022, "Unified Scaling Laws for Routed Language
Models", after BASE layers, Lewis et al. 2021).

Alternately normalising the rows and columns of exp(logits) converges to the balanced
assignment closest to the router's preferences: every token's row sums to 1 and every expert's
column to T/E. Experts are chosen by top-k on that matrix; the gate weights still come from the
router's own scores, so the balancing only moves the choice.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def sinkhorn(logits_TE: torch.Tensor, iters: int = 30, tol: float = 1e-6) -> torch.Tensor:
    """Balanced assignment [T, E]: rows sum to 1, columns to T/E (to `tol` or after `iters`)."""
    T, E = logits_TE.shape
    log_p = logits_TE.float() - logits_TE.float().max()
    row_target, col_target = 0.0, torch.log(torch.tensor(T / E))
    for _ in range(iters):
        log_p = log_p - torch.logsumexp(log_p, dim=1, keepdim=True) + row_target
        log_p = log_p - torch.logsumexp(log_p, dim=0, keepdim=True) + col_target
        if (log_p.exp().sum(dim=1) - 1).abs().max() < tol:
            break
    return log_p.exp()
