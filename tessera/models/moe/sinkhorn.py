"""Sinkhorn routing (S-BASE; Clark et al. 2022, "Unified Scaling Laws for Routed Language
Models", after BASE layers, Lewis et al. 2021).

Alternately normalising the rows and columns of exp(logits) converges to the balanced
assignment closest to the router's preferences: every token's row sums to 1 and every expert's
column to T/E. Experts are chosen by top-k on that matrix; the gate weights still come from the
router's own scores, so the balancing only moves the choice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (tensor, "sum" | "max") -> that reduction over every rank holding tokens of the micro-batch
# (context parallelism spreads them); None where this rank holds them all.
TokenReducer = Callable[[torch.Tensor, str], torch.Tensor]


def _column_logsumexp(log_p_TE: torch.Tensor, reduce: TokenReducer | None) -> torch.Tensor:
    """[1, E]: logsumexp over all the micro-batch's tokens, from the max and sum of every rank's rows."""
    if reduce is None:
        return torch.logsumexp(log_p_TE, dim=0, keepdim=True)
    m = reduce(log_p_TE.amax(dim=0, keepdim=True), "max")
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m + torch.log(reduce(torch.exp(log_p_TE - m).sum(dim=0, keepdim=True), "sum"))


@torch.no_grad()
def sinkhorn(logits_TE: torch.Tensor, iters: int = 30, tol: float = 1e-6,
             reduce: TokenReducer | None = None) -> torch.Tensor:
    """Balanced assignment [T, E]: rows sum to 1, columns to T/E (to `tol` or after `iters`).

    With `reduce`, this rank's T rows are part of a micro-batch spread over ranks: the column sums,
    the total T and the convergence test are taken over all of them (every rank stops at the same
    iteration), so each rank gets its rows of the one-process assignment."""
    T, E = logits_TE.shape
    if reduce is not None:
        T = int(reduce(torch.tensor(T, dtype=torch.int64, device=logits_TE.device), "sum").item())
    top = logits_TE.float().max()
    log_p = logits_TE.float() - (top if reduce is None else reduce(top, "max"))
    row_target, col_target = 0.0, torch.log(torch.tensor(T / E))
    for _ in range(iters):
        log_p = log_p - torch.logsumexp(log_p, dim=1, keepdim=True) + row_target
        log_p = log_p - _column_logsumexp(log_p, reduce) + col_target
        error = (log_p.exp().sum(dim=1) - 1).abs().max()
        if (error if reduce is None else reduce(error, "max")) < tol:
            break
    return log_p.exp()
