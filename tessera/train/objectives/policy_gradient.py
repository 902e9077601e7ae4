"""The GRPO objective's pure parts (issue 48's `train.objective: grpo`, not yet a mode): group-normalised
advantages, the clipped policy-gradient loss with token- or sequence-level averaging, the k3 estimate
of the KL to a reference, an entropy bonus, and truncated importance-sampling (TIS) weights for
tokens sampled by another engine. Functions of tensors only: no model, engine or process group.

A rollout is a prompt's `group_size` completions (Shao et al. 2024, DeepSeekMath: Group Relative
Policy Optimization). With rewards r_1..r_G of one group,

    advantage_i = (r_i - mean(r)) / (std(r) + eps)      (std: the unbiased one; scale=False: r_i - mean(r))

the same for every token of completion i. Per completion token t, with the policy's log-probability
logp_t (carrying the gradient), the log-probability the completion was sampled under old_t (the
policy before this update, detached) and ratio_t = exp(logp_t - old_t):

    loss_t = -min(ratio_t A, clip(ratio_t, 1 - clip_low, 1 + clip_high) A) x w_t
             + kl_coef x k3_t - entropy_coef x H_t
    k3_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (Schulman 2020: unbiased for KL(pi || ref), >= 0)
    w_t    = min(exp(old_t - engine_t), tis_cap)                (truncated importance sampling, Yao et al. 2025)

where w_t corrects for a sampling engine whose log-probabilities engine_t differ from the trainer's
old_t (w = 1 without one). The global batch's loss averages loss_t over its completions' tokens:

    averaging "token":    sum over every completion token of loss_t / (completion tokens of the batch)
    averaging "sequence": sum over completions of (mean of loss_t over its tokens) / (completions of the batch)

("token" weighs every token alike, as DAPO does; "sequence" every completion alike, as GRPO's paper).
`policy_loss_sum` returns a micro-batch's numerator; dividing by the whole global batch's
denominator (`loss_divisor`) makes accumulated micro-batches and data-parallel ranks compute the
one-batch gradient, the contract of tessera.train.objectives.loss. A token is clipped when its
ratio leaves the clip range on the side where the clip takes the gradient away (ratio above
1 + clip_high with A > 0, below 1 - clip_low with A < 0): `clipped` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from tessera.config.errors import ConfigError

AVERAGING = ("token", "sequence")
ADVANTAGE_EPS = 1e-4  # added to a group's reward std: a group of equal rewards has advantage 0, not 0/0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True,
                     eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """Each completion's advantage [N] from the rewards [N] of N / group_size groups of consecutive
    completions (module docstring); fp32."""
    if group_size < 2:
        raise ConfigError(f"train.grpo.group_size={group_size} is invalid: must be >= 2 (a group of one "
                          "completion has no advantage: its reward is its group's mean)")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ConfigError(f"{rewards.numel()} rewards do not form groups of train.grpo.group_size={group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per token, the k3 estimate of KL(policy || reference) at the sampled token (>= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def tis_weights(old_logps: torch.Tensor, engine_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Per token, the truncated importance weight min(exp(old - engine), cap) of a token the engine
    sampled with log-probability `engine_logps`, detached (a weight, not a path for the gradient)."""
    if not cap > 0:
        raise ConfigError(f"the importance-sampling cap {cap} is invalid: must be > 0")
    return torch.exp(old_logps.detach() - engine_logps.detach()).clamp(max=cap)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per position, the entropy (nats, fp32) of the distribution `logits` [..., V] define (logits
    sharded on the vocabulary by tensor parallelism are gathered whole first)."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def loss_divisor(mask: torch.Tensor, averaging: str) -> int:
    """The global batch's denominator: its completion tokens ("token") or its completions ("sequence")."""
    _check_averaging(averaging)
    return int(mask.sum()) if averaging == "token" else int(mask.shape[0])


@dataclass
class PolicyLoss:
    """A micro-batch's share of the policy-gradient objective and its figures (module docstring)."""

    loss_sum: torch.Tensor  # divided by `loss_divisor` of the global batch, it is the objective (with the gradient)
    clipped: torch.Tensor  # completion tokens whose ratio was clipped (int64, detached)
    kl_sum: torch.Tensor  # sum of k3 over the completion tokens (detached; 0 without a reference)
    tokens: torch.Tensor  # completion tokens (int64)


def policy_loss_sum(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                    clip_low: float = 0.2, clip_high: float = 0.2, averaging: str = "token",
                    ref_logps: torch.Tensor | None = None, kl_coef: float = 0.0,
                    weights: torch.Tensor | None = None, entropies: torch.Tensor | None = None,
                    entropy_coef: float = 0.0) -> PolicyLoss:
    """The clipped policy-gradient loss of B completions of T tokens (module docstring): `logps`,
    `old_logps`, `mask` (True on completion tokens) and optional `ref_logps`, `weights` (TIS),
    `entropies` are [B, T]; `advantages` [B]."""
    _check_averaging(averaging)
    if kl_coef and ref_logps is None:
        raise ConfigError(f"train.grpo.kl_coef={kl_coef} needs the reference's log-probabilities")
    if entropy_coef and entropies is None:
        raise ConfigError(f"an entropy coefficient of {entropy_coef} needs the policy's entropies")
    ratio = torch.exp(logps - old_logps.detach())
    adv = advantages.detach().float()[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if weights is not None:
        per_token = per_token * weights
    kl = k3_kl(logps, ref_logps.detach()) if ref_logps is not None else torch.zeros_like(logps)
    if kl_coef:
        per_token = per_token + kl_coef * kl
    if entropy_coef:
        per_token = per_token - entropy_coef * entropies
    m = mask.to(per_token.dtype)
    if averaging == "token":
        loss_sum = (per_token * m).sum()
    else:
        loss_sum = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).sum()
    clipped = ((ratio > 1 + clip_high) & (adv > 0)) | ((ratio < 1 - clip_low) & (adv < 0))
    return PolicyLoss(loss_sum, (clipped & mask.bool()).sum().detach(), (kl.detach() * m).sum(),
                      mask.bool().sum())


def _check_averaging(averaging: str) -> None:
    if averaging not in AVERAGING:
        raise ConfigError(f"the loss averaging {averaging!r} is invalid: one of {', '.join(AVERAGING)}")
