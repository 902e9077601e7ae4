"""Text generation from a trained model, for looking at what a checkpoint has learned.

One sequence at a time, with a key/value cache that plugs into the attention's cache seam
(`attend(layer_id, q, k, v, scale, window)`): the prompt is run once, then each new token costs
one position. Decoding is greedy (temperature 0) or sampled with temperature, top-k and top-p
(nucleus, Holtzman et al. 2020). The serving engine with paged caches and batching lives in
`tessera.infer`; this is the small, exact reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.models import Transformer


class ConcatKVCache:
    """Per-layer keys and values, grown by concatenation. Shapes: B batch, H query heads,
    G key/value heads, S new positions, T all cached positions, D head dim."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def length(self) -> int:
        return next(iter(self.keys.values())).shape[2] if self.keys else 0

    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: int | None) -> torch.Tensor:
        if layer_id in self.keys:
            k_BGSD = torch.cat([self.keys[layer_id], k_BGSD], dim=2)
            v_BGSD = torch.cat([self.values[layer_id], v_BGSD], dim=2)
        self.keys[layer_id], self.values[layer_id] = k_BGSD, v_BGSD
        S, T = q_BHSD.shape[2], k_BGSD.shape[2]
        q_pos = torch.arange(T - S, T, device=q_BHSD.device)
        k_pos = torch.arange(T, device=q_BHSD.device)
        diff = q_pos[:, None] - k_pos[None, :]  # [S, T]
        allowed = diff >= 0
        if window is not None:
            allowed &= diff < window
        gqa = q_BHSD.shape[1] != k_BGSD.shape[1]
        return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, attn_mask=allowed, scale=scale,
                                              enable_gqa=gqa)


def next_token(logits_V: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> int:
    """Pick the next token from one position's logits: argmax when temperature is 0, else sample
    from softmax(logits / temperature) restricted to the top_k tokens and the smallest set whose
    probability reaches top_p."""
    if temperature <= 0:
        return int(logits_V.argmax())
    logits = logits_V.float() / temperature
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep tokens until top_p is reached
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_ids: tuple[int, ...] = (), use_cache: bool = True) -> list[int]:
    """The new token ids after `prompt_ids` (at most `max_new_tokens`, ending early at a stop id).

    With use_cache=False every step recomputes the whole prefix: slower, same tokens (a check of
    the cache).
    """
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    cache = ConcatKVCache() if use_cache else None
    ids = list(prompt_ids)
    pending = ids
    out: list[int] = []
    for _ in range(max_new_tokens):
        if len(ids) > model.cfg.max_seq_len:
            break
        start = cache.length() if cache is not None else 0
        x = torch.tensor([pending if cache is not None else ids], device=device)
        positions = torch.arange(start, start + x.shape[1], device=device)[None]
        logits = model(x, positions=positions, cache=cache).logits[0, -1]
        token = next_token(logits.cpu(), temperature, top_k, top_p, generator)
        out.append(token)
        ids.append(token)
        pending = [token]
        if token in stop_ids:
            break
    return out
