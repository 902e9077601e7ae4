"""Speculative sampling keeps the target distribution (Leviathan et al. 2023, Chen et al. 2023).

Checked statistically with fixed seeds on tiny vocabularies, with tolerances several times the
sampling noise (and far below the error of accepting every draft, which each test also shows)."""

import pytest
import torch

from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.infer.runner.rejection_sampling import verify_greedy, verify_sampled
from tests.infer.tiny_models import write_model


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def assert_sampled_tokens_keep_the_target(llm: LLM, prompt: list[int], want2: torch.Tensor, want3: torch.Tensor,
                                          n: int = 6000) -> None:
    """n seeded 3-token samples of `prompt` with speculation: drafts were proposed and some, not all,
    accepted, and the 2nd and 3rd tokens' frequencies are within 0.05 (total variation) of the
    target's own marginals `want2`, `want3`."""
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    m = llm.engine.metrics
    assert m.spec_proposed > 0 and 0 < m.acceptance_rate < 1
    got2 = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=8).float() / n
    got3 = torch.bincount(torch.tensor([o.token_ids[2] for o in outs]), minlength=8).float() / n
    assert tv(got2, want2) < 0.05 and tv(got3, want3) < 0.05


def test_greedy_verification_accepts_the_agreeing_prefix():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_emitted_tokens_follow_the_target(deterministic_draft):
    V, k, n = 6, 3, 20000
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    assert tv(p, q) > 0.2  # accepting drafts blindly would be far off
    top = int(p.argmax())
    counts = torch.zeros(2, V)
    for _ in range(n):
        if deterministic_draft:  # a fixed guess, as prompt lookup makes
            drafts, q_rows = [top, top, 3], None
        else:
            drafts = torch.multinomial(q, k, replacement=True, generator=gen).tolist()
            q_rows = q.expand(k, V)
        out = verify_sampled(p.expand(k + 1, V), drafts, q_rows, gen)
        assert 1 <= len(out) <= k + 1
        for pos, tok in enumerate(out[:2]):
            counts[pos, tok] += 1
    assert counts[1].sum() > n / 4  # enough second tokens to measure them
    first = counts[0] / counts[0].sum()
    second = counts[1] / counts[1].sum()
    assert tv(first, p) < 0.03 and tv(second, p) < 0.03


@pytest.mark.slow
def test_engine_sampling_with_a_draft_model_keeps_the_target_distribution(tmp_path):
    """Second and third tokens (produced by verification) of 6000 seeded requests against the
    exact marginals computed from the target model."""
    small = dict(vocab_size=8, num_hidden_layers=1)
    hf = write_model(tmp_path / "target", "llama", seed=0, std=0.5, **small)
    draft = write_model(tmp_path / "draft", "llama", seed=5, std=0.5, **small)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        two = torch.tensor([prompt + [a] for a in range(8)])
        p2 = torch.softmax(hf(two).logits[:, -1], -1)  # [t1, t2]
        three = torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])
        p3 = torch.softmax(hf(three).logits[:, -1], -1).view(8, 8, 8)
        q2 = torch.softmax(draft(two).logits[:, -1], -1)
    want2 = p1 @ p2
    want3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    assert tv(want2, p1 @ q2) > 0.1  # the draft disagrees with the target
    llm = LLM(tmp_path / "target", block_size=4, max_num_seqs=256, max_num_batched_tokens=2048,
              enable_prefix_caching=False,
              speculative=SpeculativeConfig(method="draft", num_tokens=2, draft_model=str(tmp_path / "draft")))
    assert_sampled_tokens_keep_the_target(llm, prompt, want2, want3)
