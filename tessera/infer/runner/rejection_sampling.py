"""Verifying speculated tokens so that the output follows the target model exactly.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", algorithm 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling",
algorithm 2). A proposer drafted tokens d_1..d_k from distributions q_1..q_k; the target gives
p_1..p_{k+1} for the same positions in one forward pass. For i = 1..k:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
    on the first rejection emit a token from  norm(max(0, p_i - q_i))  and stop;

if all k are accepted, emit a bonus token from p_{k+1}. Every emitted token is then distributed
exactly as the target would have produced it one at a time. A deterministic proposer (prompt
lookup) has q_i = one-hot(d_i): d_i is accepted with probability p_i(d_i), and a rejection draws
from p_i with d_i removed. Greedy requests have one-hot p_i, which makes the rule "accept while
d_i is the target's argmax, then emit the argmax", identical to decoding without speculation.

Shapes: K drafted tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from tessera.infer.sampling.sampler import sample_from


def verify_greedy(target_argmax: list[int], draft_tokens: list[int]) -> list[int]:
    """Tokens emitted for a greedy request: the accepted prefix of the drafts plus the target's
    own token at the first disagreement (or after the last draft). `target_argmax` has K+1 ids."""
    out: list[int] = []
    for drafted, wanted in zip(draft_tokens, target_argmax):
        if drafted != wanted:
            break
        out.append(drafted)
    out.append(target_argmax[len(out)])
    return out


def verify_sampled(target_probs_KV: torch.Tensor, draft_tokens: list[int], draft_probs_KV: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """Tokens emitted for a sampled request. `target_probs_KV` has K+1 rows (the last one for the
    bonus token); `draft_probs_KV` has K rows, or is None for a deterministic proposer."""
    out: list[int] = []
    for i, d in enumerate(draft_tokens):
        p = target_probs_KV[i]
        if draft_probs_KV is None:
            q_d = 1.0
            residual = p.clone()
            residual[d] = 0.0
        else:
            q = draft_probs_KV[i]
            q_d = float(q[d])
            residual = torch.clamp(p - q, min=0.0)
        accept_prob = 1.0 if q_d <= 0.0 else min(1.0, float(p[d]) / q_d)
        u = float(torch.rand((), generator=generator))
        if u < accept_prob:
            out.append(d)
            continue
        if float(residual.sum()) <= 0.0:  # only reachable through rounding: p == q on the support
            residual = p
        out.append(sample_from(residual, generator))
        return out
    out.append(sample_from(target_probs_KV[len(draft_tokens)], generator))
    return out
