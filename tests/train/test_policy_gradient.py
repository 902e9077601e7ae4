"""GRPO's pure parts (tessera/train/objectives/policy_gradient.py) against a hand-written reference:
plain Python arithmetic over floats, token by token, on fixed rollouts. Advantages per group, the
clipped loss and its gradient with respect to the policy's log-probabilities (token- and sequence-
level averaging), which tokens are clipped, the k3 KL, TIS weights and the entropy term; micro-batches
divided by the global batch's divisor sum to the whole batch's loss; bad settings refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.train.objectives.policy_gradient import (
    group_advantages,
    k3_kl,
    loss_divisor,
    policy_loss_sum,
    tis_weights,
    token_entropy,
)

# four completions (two groups of two) of up to four tokens; ratios chosen on both sides of the clip range
OLD = [[-1.0, -2.0, -0.5, -3.0], [-0.7, -1.2, -2.2, -0.4], [-1.5, -0.9, -1.1, -2.5], [-0.3, -0.6, -1.9, -1.0]]
NEW = [[-0.6, -2.1, -0.5, -2.0], [-0.7, -1.6, -1.7, -0.4], [-1.0, -0.95, -1.5, -2.5], [-0.35, -0.2, -1.9, -1.3]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]
REF = [[-0.9, -1.8, -0.7, -2.0], [-0.5, -1.4, -2.0, -0.6], [-1.2, -1.0, -1.0, -2.0], [-0.4, -0.5, -1.7, -1.1]]
ENGINE = [[-1.05, -1.9, -0.5, -3.0], [-0.7, -1.3, -2.0, -0.45], [-1.4, -0.9, -1.2, -2.5], [-0.25, -0.9, -1.9, -1.0]]
REWARDS = [1.0, 0.0, 0.25, 2.0]


def _hand_advantages(rewards, group):
    out = []
    for g in range(0, len(rewards), group):
        rs = rewards[g:g + group]
        mean = sum(rs) / group
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (group - 1))
        out += [(r - mean) / (std + 1e-4) for r in rs]
    return out


def _hand_token(new, old, adv, ref, w, eps_low, eps_high, kl_coef, entropy, entropy_coef):
    """(loss, d loss / d new, clipped) of one token, by hand."""
    ratio = math.exp(new - old)
    clipped_ratio = min(max(ratio, 1 - eps_low), 1 + eps_high)
    unclipped_term, clipped_term = ratio * adv, clipped_ratio * adv
    loss = -min(unclipped_term, clipped_term) * w
    # the gradient flows through ratio unless the clipped branch is the smaller and clamps
    flows = unclipped_term <= clipped_term or 1 - eps_low <= ratio <= 1 + eps_high
    grad = -adv * ratio * w if flows else 0.0
    loss += kl_coef * (math.exp(ref - new) - (ref - new) - 1)
    grad += kl_coef * (1 - math.exp(ref - new))
    loss -= entropy_coef * entropy
    clipped = (ratio > 1 + eps_high and adv > 0) or (ratio < 1 - eps_low and adv < 0)
    return loss, grad, clipped


def _hand_loss(averaging, eps_low=0.2, eps_high=0.28, kl_coef=0.0, weights=None, entropies=None, entropy_coef=0.0):
    adv = _hand_advantages(REWARDS, 2)
    total, grads, clipped = 0.0, [[0.0] * 4 for _ in OLD], 0
    n_tokens, n_seqs = sum(map(sum, MASK)), len(MASK)
    for i, row in enumerate(MASK):
        length = sum(row)
        for t, keep in enumerate(row):
            if not keep:
                continue
            w = weights[i][t] if weights is not None else 1.0
            h = entropies[i][t] if entropies is not None else 0.0
            loss, grad, c = _hand_token(NEW[i][t], OLD[i][t], adv[i], REF[i][t], w, eps_low, eps_high, kl_coef, h,
                                        entropy_coef)
            scale = 1 / n_tokens if averaging == "token" else 1 / (length * n_seqs)
            total += loss * scale
            grads[i][t] = grad * scale
            clipped += c
    return total, grads, clipped


def _tensors():
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    return new, torch.tensor(OLD, dtype=torch.float64), torch.tensor(MASK, dtype=torch.bool)


def test_advantages_are_normalised_within_each_group():
    got = group_advantages(torch.tensor(REWARDS), 2)
    assert got.tolist() == pytest.approx(_hand_advantages(REWARDS, 2), rel=1e-6)
    # a group of equal rewards has no advantage; unscaled advantages are the rewards less the group mean
    assert group_advantages(torch.tensor([3.0, 3.0, 3.0, 1.0, 2.0, 6.0]), 3).tolist()[:3] == [0.0, 0.0, 0.0]
    assert group_advantages(torch.tensor([1.0, 2.0, 6.0]), 3, scale=False).tolist() == pytest.approx([-2, -1, 3])


@pytest.mark.parametrize("averaging", ["token", "sequence"])
def test_the_clipped_loss_and_its_gradient_equal_the_hand_computation(averaging):
    new, old, mask = _tensors()
    adv = group_advantages(torch.tensor(REWARDS), 2).double()
    out = policy_loss_sum(new, old, adv, mask, clip_low=0.2, clip_high=0.28, averaging=averaging)
    loss = out.loss_sum / loss_divisor(mask, averaging)
    loss.backward()
    want, grads, clipped = _hand_loss(averaging)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(new.grad, torch.tensor(grads, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    assert int(out.clipped) == clipped and 0 < clipped < int(mask.sum())  # some tokens clipped, not all
    assert int(out.tokens) == 13 and float(out.kl_sum) == 0
    # the two averagings weigh completions of different lengths differently
    other = "sequence" if averaging == "token" else "token"
    assert _hand_loss(other)[0] != pytest.approx(want)


def test_k3_kl_tis_weights_and_the_entropy_term_equal_the_hand_computation():
    new, old, mask = _tensors()
    ref, engine = torch.tensor(REF, dtype=torch.float64), torch.tensor(ENGINE, dtype=torch.float64)
    weights = tis_weights(old, engine, cap=1.1)
    hand_w = [[min(math.exp(o - e), 1.1) for o, e in zip(ro, re)] for ro, re in zip(OLD, ENGINE)]
    torch.testing.assert_close(weights, torch.tensor(hand_w, dtype=torch.float64))
    assert float(weights.max()) == 1.1 and not weights.requires_grad  # truncated, and not differentiated
    kl = k3_kl(new.detach(), ref)
    assert float(kl.min()) >= 0 and float(k3_kl(ref, ref).abs().max()) == 0
    entropies = torch.rand(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    adv = group_advantages(torch.tensor(REWARDS), 2).double()
    out = policy_loss_sum(new, old, adv, mask, clip_low=0.2, clip_high=0.28, averaging="token", ref_logps=ref,
                          kl_coef=0.05, weights=weights, entropies=entropies, entropy_coef=0.01)
    loss = out.loss_sum / loss_divisor(mask, "token")
    loss.backward()
    want, grads, _ = _hand_loss("token", kl_coef=0.05, weights=hand_w, entropies=entropies.tolist(),
                                entropy_coef=0.01)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(new.grad, torch.tensor(grads, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    assert float(out.kl_sum) == pytest.approx(float((kl * mask).sum()), rel=1e-12)


def test_token_entropy_is_the_distributions_entropy():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, -10.0, -10.0, -10.0]])
    got = token_entropy(logits)
    assert float(got[0]) == pytest.approx(math.log(4)) and float(got[1]) < 1e-6


@pytest.mark.parametrize("averaging", ["token", "sequence"])
def test_micro_batches_over_the_global_divisor_sum_to_the_whole_batch(averaging):
    new, old, mask = _tensors()
    adv = group_advantages(torch.tensor(REWARDS), 2).double()
    divisor = loss_divisor(mask, averaging)
    whole = policy_loss_sum(new, old, adv, mask, averaging=averaging).loss_sum / divisor
    parts = sum(policy_loss_sum(new[r], old[r], adv[r], mask[r], averaging=averaging).loss_sum / divisor
                for r in (slice(0, 1), slice(1, 3), slice(3, 4)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-12)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"train.grpo.group_size=1 is invalid: must be >= 2 \(a group of one"):
        group_advantages(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ConfigError, match=r"3 rewards do not form groups of train.grpo.group_size=2"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)
    new, old, mask = _tensors()
    adv = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"the loss averaging 'mean' is invalid: one of token, sequence"):
        policy_loss_sum(new, old, adv, mask, averaging="mean")
    with pytest.raises(ConfigError, match=r"train.grpo.kl_coef=0.1 needs the reference's log-probabilities"):
        policy_loss_sum(new, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ConfigError, match=r"the importance-sampling cap 0 is invalid: must be > 0"):
        tis_weights(old, old, cap=0)
