"""Balancing losses and Sinkhorn against small hand-computed cases."""

import math

import torch

from tessera.models.moe import (
    load_balancing_loss,
    router_z_loss,
    sequence_load_balancing_loss,
    sinkhorn,
    tokens_per_expert,
)


def test_load_balancing_loss_hand_example():
    # 4 tokens, 2 experts, top-1. Experts chosen: 0, 0, 0, 1 -> f = [3/4, 1/4].
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    idx = torch.tensor([[0], [0], [0], [1]])
    counts = tokens_per_expert(idx, 2)
    assert counts.tolist() == [3, 1]
    # P = mean probs = [0.65, 0.35]; loss = E * sum f P = 2 * (0.75*0.65 + 0.25*0.35) = 1.15
    loss = load_balancing_loss(probs, counts, top_k=1)
    assert math.isclose(loss.item(), 1.15, rel_tol=1e-6)


def test_load_balancing_loss_is_one_when_uniform():
    probs = torch.full((8, 4), 0.25)
    idx = torch.tensor([[0, 1], [2, 3]] * 4)
    loss = load_balancing_loss(probs, tokens_per_expert(idx, 4), top_k=2)
    assert math.isclose(loss.item(), 1.0, rel_tol=1e-6)


def test_load_balancing_loss_spread_over_ranks_adds_up():
    """Two ranks holding half the tokens each, with micro-batch-wide counts, sum to the whole loss."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(10, 4, generator=gen), -1)
    idx = probs.topk(2, dim=-1).indices
    counts = tokens_per_expert(idx, 4)
    whole = load_balancing_loss(probs, counts, 2)
    parts = load_balancing_loss(probs[:5], counts, 2, num_tokens=10) + load_balancing_loss(probs[5:], counts, 2, 10)
    torch.testing.assert_close(parts, whole)


def test_sequence_load_balancing_loss_hand_example():
    # Two sequences of 2 tokens, 2 experts, top-1.
    probs = torch.tensor([[[1.0, 0.0], [1.0, 0.0]],     # seq 0: all to expert 0 -> f=[1,0], P=[1,0] -> 2*1 = 2
                          [[0.5, 0.5], [0.5, 0.5]]])    # seq 1: experts 0,1 -> f=[.5,.5], P=[.5,.5] -> 2*.5 = 1
    idx = torch.tensor([[[0], [0]], [[0], [1]]])
    loss = sequence_load_balancing_loss(probs, idx)
    assert math.isclose(loss.item(), 1.5, rel_tol=1e-6)


def test_router_z_loss_hand_example():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp: log 2 and log 4 -> mean of squares
    want = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert math.isclose(router_z_loss(logits).item(), want, rel_tol=1e-6)


def test_sinkhorn_hand_example_and_marginals():
    # 2x2 with exp(logits) = [[2, 1], [1, 1]]: rows sum 1 and columns sum T/E = 1.
    # The solution is diag(a) K diag(b) with a0*b0*2 + a0*b1 = 1 etc; solved: P = [[s, 1-s], [1-s, s]]
    # with s/(1-s) * s/(1-s) = 2 (cross-ratio kept) -> s = sqrt(2)/(1+sqrt(2)).
    P = sinkhorn(torch.log(torch.tensor([[2.0, 1.0], [1.0, 1.0]])), iters=200)
    s = math.sqrt(2) / (1 + math.sqrt(2))
    torch.testing.assert_close(P, torch.tensor([[s, 1 - s], [1 - s, s]]), atol=1e-5, rtol=0)


def test_sinkhorn_balances_a_router_that_prefers_one_expert():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4, generator=gen) * 0.1
    logits[:, 0] += 3.0  # every token prefers expert 0
    assert tokens_per_expert(logits.topk(1).indices, 4).tolist()[0] == 64
    P = sinkhorn(logits, iters=100)
    torch.testing.assert_close(P.sum(1), torch.ones(64), atol=1e-4, rtol=0)
    torch.testing.assert_close(P.sum(0), torch.full((4,), 16.0), atol=1e-3, rtol=0)
    counts = tokens_per_expert(P.topk(1).indices, 4)
    assert counts.max().item() <= 24  # near 16 each instead of 64 on one
