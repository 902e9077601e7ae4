"""Logit bias and the repetition, frequency and presence penalties of a batch's sampled rows.

Applied in vLLM's order to the logits a request samples from (greedy requests take the argmax
of the result): `logit_bias` is added; tokens seen in the prompt or the output have positive
logits divided and negative ones multiplied by `repetition_penalty` (HuggingFace's definition);
`frequency_penalty` times each token's count in the output and `presence_penalty` where that
count is positive are subtracted (OpenAI's definitions). A row whose request asks none of them
comes out unchanged, bit for bit. The per-row tables are built on the host from each request's
tokens and moved to the device with the step's other inputs.
Shapes: B rows, V vocabulary.
"""

from __future__ import annotations

import torch

from tessera.infer.engine.sequence import Sequence


def changes_logits(seqs: list[Sequence]) -> bool:
    return any(s.params.changes_logits for s in seqs)


def _pairs(rows: list[tuple[int, list[int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of every row, as device tensors."""
    r = [i for i, toks in rows for _ in toks]
    t = [tok for _, toks in rows for tok in toks]
    return (torch.tensor(r, dtype=torch.long).to(device, non_blocking=True),
            torch.tensor(t, dtype=torch.long).to(device, non_blocking=True))


def apply_penalties(logits_BV: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """fp32 logits of `seqs` (one row each) with their biases and penalties applied."""
    logits = logits_BV.float().clone()
    B, V = logits.shape
    device = logits.device
    params = [s.params for s in seqs]
    bias = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if bias:
        rows, ids = _pairs([(i, list(b)) for i, b in bias], device)
        values = torch.tensor([v for _, b in bias for v in b.values()], dtype=torch.float32).to(device)
        logits.index_put_((rows, ids), values, accumulate=True)
    repeat = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeat:
        seen = torch.zeros(B, V, dtype=torch.bool, device=device)
        rows, ids = _pairs([(i, seqs[i].token_ids) for i in repeat], device)
        seen[rows, ids] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32).to(device)[:, None]
        changed = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, changed, logits)
    counted = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if counted:
        counts = torch.zeros(B, V, dtype=torch.float32, device=device)
        rows, ids = _pairs([(i, seqs[i].output_ids) for i in counted], device)
        counts.index_put_((rows, ids), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32).to(device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32).to(device)[:, None]
        changed = logits - frequency * counts - presence * (counts > 0).float()
        rows_with = torch.zeros(B, 1, dtype=torch.bool, device=device)
        rows_with[counted] = True
        logits = torch.where(rows_with, changed, logits)
    return logits
