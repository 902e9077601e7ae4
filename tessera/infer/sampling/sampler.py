"""Turning logits into tokens: temperature, top-k, top-p (nucleus), greedy, seeded sampling.

Shapes: N rows (positions of one request), V vocabulary. Everything is computed in fp32.
"""

from __future__ import annotations

import torch

from tessera.infer.sampling.params import SamplingParams


def processed_probs(logits_NV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) restricted to the top-k
    tokens and to the nucleus of mass top_p (Holtzman et al. 2020), renormalised. For greedy
    requests it is the one-hot of the argmax, so speculative verification treats both alike."""
    logits = logits_NV.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # probability of the strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs_V: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from `probs_V` (which need not be normalised) with `generator`, a CPU
    generator, so the draw is the same on any device."""
    return int(torch.multinomial(probs_V.float().cpu(), 1, generator=generator).item())


def next_token(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token of a request: argmax when greedy, else a draw from `processed_probs`."""
    if params.greedy:
        return int(logits_V.argmax().item())
    return sample_from(processed_probs(logits_V[None], params)[0], generator)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for one request; its draws do not depend on other requests."""
    return torch.Generator().manual_seed(seed)
