"""Router scores and expert selection: softmax or sigmoid scores, top-k before or after the
softmax, group-limited top-k (DeepSeek-V3), renormalisation and scaling of the gate weights.

All arithmetic is fp32 whatever the model's dtype. Shapes: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch


def router_scores(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-expert affinity: softmax over experts (Shazeer et al. 2017; Mixtral) or an independent
    sigmoid per expert (DeepSeek-V3, arXiv 2412.19437 eq. 15)."""
    logits_TE = logits_TE.float()
    if score_func == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score_func == "sigmoid":
        return torch.sigmoid(logits_TE)
    raise ValueError(f"score_func must be softmax or sigmoid, got {score_func!r}")


def balancing_probs(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Probabilities P used by the balancing losses: softmax, or sigmoid scores normalised to sum
    to one per token (DeepSeek-V3 eq. 19)."""
    scores = router_scores(logits_TE, score_func)
    if score_func == "sigmoid":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores


def group_limited_topk(choice_TE: torch.Tensor, k: int, n_groups: int, topk_groups: int) -> torch.Tensor:
    """Indices [T, k] of the top-k experts inside the `topk_groups` best groups (DeepSeek-V3 node-
    limited routing). A group's score is the sum of its two highest expert scores."""
    T, E = choice_TE.shape
    if n_groups == 1:
        return choice_TE.topk(k, dim=-1).indices
    grouped = choice_TE.view(T, n_groups, E // n_groups)
    group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_groups]
    keep = group_score.topk(topk_groups, dim=-1).indices
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
    masked = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(T, E)
    return masked.topk(k, dim=-1).indices


def topk_gates(logits_TE: torch.Tensor, *, k: int, score_func: str = "softmax", softmax_before_topk: bool = True,
               norm_topk_prob: bool = True, scaling_factor: float = 1.0, n_groups: int = 1, topk_groups: int = 1,
               expert_bias_E: torch.Tensor | None = None, choice_TE: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [T, k], gate weights [T, k] fp32).

    The experts are chosen on `choice_TE` if given (Sinkhorn), else on the scores plus the
    aux-loss-free `expert_bias_E` (which never enters the gate weights). The weights come from the
    unbiased scores: renormalised over the k chosen when `norm_topk_prob`, times `scaling_factor`.
    With softmax and softmax_before_topk=False, top-k is taken on the logits and the softmax runs
    over the k chosen only (Megatron's default ordering); renormalisation is then implicit.
    """
    logits_TE = logits_TE.float()
    if score_func == "softmax" and not softmax_before_topk:
        choice = logits_TE if choice_TE is None else choice_TE
        if expert_bias_E is not None:
            choice = choice + expert_bias_E
        idx = group_limited_topk(choice, k, n_groups, topk_groups)
        weights = torch.softmax(logits_TE.gather(1, idx), dim=-1)
        return idx, weights * scaling_factor
    scores = router_scores(logits_TE, score_func)
    choice = scores if choice_TE is None else choice_TE
    if expert_bias_E is not None:
        choice = choice + expert_bias_E.float()
    idx = group_limited_topk(choice, k, n_groups, topk_groups)
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if score_func == "sigmoid" else 0.0))
    return idx, weights * scaling_factor
