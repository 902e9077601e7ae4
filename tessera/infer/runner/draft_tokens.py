"""What a proposer hands the model runner (`Proposal`), and how a model-based draft picks its tokens
(`draw_tokens`): shared by the draft-model proposer (speculative.py) and the MTP one
(mtp_proposer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.infer.engine.sequence import Sequence
from tessera.infer.sampling.sampler import processed_probs, sample_from


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(tokens), V] draft distributions; None: deterministic proposer


def draw_tokens(seqs: list[Sequence], logits_RV: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """The next draft token of each of `seqs` from its row of `logits_RV`: the greedy ones' argmaxes
    come to the host in one transfer; sampled ones draw from their processed distribution q."""
    greedy = [r for r, seq in enumerate(seqs) if seq.params.greedy]
    argmax = dict(zip(greedy, logits_RV[greedy].argmax(-1).tolist())) if greedy else {}
    out: list[tuple[int, torch.Tensor | None]] = []
    for r, seq in enumerate(seqs):
        if r in argmax:
            out.append((argmax[r], None))
        else:
            q = processed_probs(logits_RV[r:r + 1], seq.params)[0]
            out.append((sample_from(q, seq.generator), q))
    return out
