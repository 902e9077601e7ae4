"""The DPO objective (train.objective=dpo, tessera.config.dpo): answer log-probabilities and the
per-pair losses and rewards, pure functions of tensors (the DPO mode, tessera.train.modes.dpo,
runs the models and sums them over the global batch).

    logps, tokens = answer_logps(logits, targets)      # per row: sum over its answer tokens, their count
    scores = pair_scores(policy_c, policy_r, ref_c, ref_r, beta, "sigmoid", tokens_c, tokens_r)

An answer's log-probability is the sum over its tokens (the targets that are not IGNORE_INDEX) of
log p(token | the tokens before it), computed in fp32 from the logits. With the log-ratios
r = log pi(answer) - log ref(answer) of the policy against the reference:

    sigmoid: loss = -log sigmoid(beta (r_chosen - r_rejected))
    ipo:     loss = (r_chosen / n_chosen - r_rejected / n_rejected - 1 / (2 beta))^2   (n: answer tokens)

and each answer's reward is beta r, as TRL's DPOTrainer defines them (its `loss_type` "sigmoid" and
"ipo"; tests/train/test_dpo_trl.py holds the two to each other).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.config.errors import ConfigError
from tessera.train.objectives.loss import IGNORE_INDEX, token_logps


def answer_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [R] sum of each row's answer-token log-probabilities, int64 [R] its answer tokens) of
    logits [R, S, V] and targets [R, S] (IGNORE_INDEX outside the answer)."""
    return token_logps(logits, targets).sum(-1), (targets != IGNORE_INDEX).sum(-1)


@dataclass
class PairScores:
    """Per pair of a batch: the loss and the two answers' rewards (beta x log-ratio), each [P]."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_scores(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, beta: float, loss: str, chosen_tokens: torch.Tensor,
                rejected_tokens: torch.Tensor) -> PairScores:
    """The DPO loss of each pair (module docstring) from its answers' log-probabilities, each [P]."""
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if loss == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif loss == "ipo":
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ConfigError(f"train.dpo.loss={loss!r} is invalid: one of sigmoid, ipo")
    return PairScores(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
