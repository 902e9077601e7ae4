"""Expert choice, capacity dropping, gradients through the gates, and the expert bias."""

import torch

from tessera.config import MoEConfig
from tessera.models.moe import (
    MoE,
    Router,
    capacity_keep_mask,
    expert_capacity,
    group_limited_topk,
    topk_gates,
    update_expert_bias,
)


def test_softmax_then_topk_renormalised_equals_topk_then_softmax():
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(0))
    i1, w1 = topk_gates(logits, k=2, softmax_before_topk=True, norm_topk_prob=True)
    i2, w2 = topk_gates(logits, k=2, softmax_before_topk=False)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2)


def test_gates_without_renormalisation_and_with_scaling():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    p = torch.softmax(logits, -1)[0]
    idx, w = topk_gates(logits, k=2, norm_topk_prob=False, scaling_factor=2.0)
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w, 2.0 * p[:2].view(1, 2))


def test_sigmoid_scores_with_renormalisation():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    s = torch.sigmoid(logits)[0]
    idx, w = topk_gates(logits, k=2, score_func="sigmoid", norm_topk_prob=True, scaling_factor=2.5)
    assert idx.tolist() == [[1, 3]]
    torch.testing.assert_close(w, 2.5 * torch.stack([s[1], s[3]]).view(1, 2) / (s[1] + s[3]))


def test_group_limited_topk_hand_example():
    # 8 experts in 4 groups of 2; a group's score is its top-2 sum: g0=1.1, g1=1.0, g2=0.95, g3=0.6.
    scores = torch.tensor([[0.9, 0.2, 0.5, 0.5, 0.95, 0.0, 0.3, 0.3]])
    idx = group_limited_topk(scores, k=3, n_groups=4, topk_groups=2)
    # Expert 4 (0.95, the single best) is excluded: its group g2 is not among the 2 best.
    assert sorted(idx[0].tolist()) == [0, 2, 3]


def test_expert_bias_changes_choice_but_not_weights():
    logits = torch.tensor([[1.0, 0.9, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0])
    idx, w = topk_gates(logits, k=1, score_func="sigmoid", norm_topk_prob=False, expert_bias_E=bias)
    assert idx.tolist() == [[2]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[-1.0]])))


def test_capacity_and_dropping_by_probability_and_position():
    # 4 tokens, 2 experts, top-1, factor 1 -> capacity ceil(4*1/2*1) = 2.
    assert expert_capacity(4, 2, 1, 1.0) == 2
    idx = torch.tensor([[0], [0], [0], [1]])
    w = torch.tensor([[0.6], [0.9], [0.7], [0.8]])
    # By position: expert 0 keeps tokens 0 and 1, drops token 2.
    assert capacity_keep_mask(idx, w, 2, 2, "position").flatten().tolist() == [True, True, False, True]
    # By probability: expert 0 keeps its two highest gates (tokens 1 and 2), drops token 0.
    assert capacity_keep_mask(idx, w, 2, 2, "probs").flatten().tolist() == [False, True, True, True]


def test_capacity_top2_hand_example():
    # 3 tokens, 2 experts, top-2: every token picks both experts; capacity 2 drops one slot each.
    idx = torch.tensor([[0, 1], [1, 0], [0, 1]])
    w = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.7, 0.3]])
    assert capacity_keep_mask(idx, w, 2, 2, "position").tolist() == [[True, True], [True, True], [False, False]]
    # Expert 0 gates: t0 .5, t1 .1, t2 .7 -> keep t2, t0. Expert 1: t0 .5, t1 .9, t2 .3 -> keep t1, t0.
    assert capacity_keep_mask(idx, w, 2, 2, "probs").tolist() == [[True, True], [True, False], [True, False]]


def _moe(**kw):
    cfg = MoEConfig(num_experts=4, top_k=2, ffn_dim=8, **kw)
    moe = MoE(16, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe


def test_dropped_slots_contribute_nothing_and_padding_changes_nothing():
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(1))
    dropless = _moe()
    dropped = _moe(capacity_factor=0.5, drop_policy="position")
    padded = _moe(capacity_factor=0.5, drop_policy="position", pad_to_capacity=True)
    y_full, _ = dropless(x)
    y_drop, route = dropped(x)
    y_pad, _ = padded(x)
    torch.testing.assert_close(y_pad, y_drop)
    assert not torch.allclose(y_full, y_drop)
    # Recompute the dropped output by hand: only kept slots, weighted by their gates.
    keep = capacity_keep_mask(route.indices_Tk, route.weights_Tk, 4, expert_capacity(12, 4, 2, 0.5), "position")
    x_TD = x.view(12, 16)
    want = torch.zeros_like(x_TD)
    ex = dropped.experts
    for t in range(12):
        for s in range(2):
            if keep[t, s]:
                e = route.indices_Tk[t, s]
                h = torch.nn.functional.silu(x_TD[t] @ ex.w1[e].T) * (x_TD[t] @ ex.w3[e].T)
                want[t] += route.weights_Tk[t, s] * (h @ ex.w2[e].T)
    torch.testing.assert_close(y_drop.view(12, 16), want, atol=1e-5, rtol=1e-5)


def test_gradients_reach_the_router_through_the_gates():
    moe = _moe()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    y, route = moe(x)
    assert route.losses == {}  # no auxiliary loss configured: the gate weights are the only path
    y.square().sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_router_is_fp32_in_a_bf16_model():
    router = Router(16, MoEConfig(num_experts=4, top_k=2, ffn_dim=8, aux_loss_coef=0.01, z_loss_coef=1e-3))
    router.to(torch.bfloat16)
    out = router(torch.randn(6, 16, dtype=torch.bfloat16), (1, 6))
    assert out.weights_Tk.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in out.losses.values())


def test_jitter_only_in_training():
    router = Router(16, MoEConfig(num_experts=4, top_k=2, ffn_dim=8, jitter_eps=0.5))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))
    router.eval()
    a, b = router(x, (1, 32)), router(x, (1, 32))
    assert torch.equal(a.weights_Tk, b.weights_Tk)
    router.train()
    torch.manual_seed(0)
    c = router(x, (1, 32))
    assert not torch.equal(a.weights_Tk, c.weights_Tk)


def test_expert_bias_moves_toward_balance():
    cfg = MoEConfig(num_experts=4, top_k=1, ffn_dim=8, score_func="sigmoid", expert_bias=True, bias_update_rate=0.05)
    router = Router(16, cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 0.2)
        router.weight[0] += 0.5  # expert 0 is favoured
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1)).abs()
    first = router(x, (1, 256)).counts_E
    for _ in range(60):
        router.update_bias(router(x, (1, 256)).counts_E)
    last = router(x, (1, 256)).counts_E
    assert first.max() - first.min() > last.max() - last.min()
    assert router.expert_bias[0] < 0  # the over-loaded expert's bias went down


def test_update_expert_bias_step():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10, 2, 4, 4]), rate=0.1)  # mean 5
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))


def test_top1_is_renormalised_like_huggingface():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    _, w = topk_gates(logits, k=1, norm_topk_prob=True)
    torch.testing.assert_close(w, torch.ones(1, 1))
    _, w = topk_gates(logits, k=1, norm_topk_prob=False)
    torch.testing.assert_close(w, torch.softmax(logits, -1)[:, :1])
