"""Eager reference generation: one sequence, a plain key/value cache, the model's own forward.

The serving engine (`LLMEngine`: paged cache, continuous batching, chunked prefill) is what
`tessera generate`, `LLM` and the server run. This is the small, exact reference the engine is
checked against: the prompt is run once, then each new token costs one position, with keys and
values kept in a cache that plugs into the attention's cache seam
(`attend(layer_id, q, k, v, scale, window)`; DeepSeek-V3.2's sparse attention also keeps its indexer
keys here, `attend_sparse`, tessera/models/attention_variants/sparse_mla.py); a hybrid model's
linear-attention layers keep their
recurrent state in it too (`recurrent_state` / `keep_recurrent_state`). With `use_cache=False` every step recomputes the
whole prefix, a check of the cache itself. Tokens are picked by the engine's own sampler
(`tessera.infer.sampling.device_sampling`, counter-based seeds), so both paths read `SamplingParams` the
same way and a seeded request gives the same tokens on both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.infer.sampling.device_sampling import SamplingBatch, sample_on_device
from tessera.infer.sampling.params import SamplingParams
from tessera.models import ModelInput, Transformer
from tessera.models.attention import Window, window_allows
from tessera.models.attention_variants.attention_sinks import sink_attention
from tessera.models.attention_variants.sparse_mla import KeyChoice


class ConcatKVCache:
    """Per-layer keys and values, grown by concatenation. Shapes: B batch, H query heads,
    G key/value heads, S new positions, T all cached positions, D head dim."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.states: dict[int, object] = {}  # linear-attention layer -> its recurrent state (DeltaNetState)
        self.index_keys: dict[int, torch.Tensor] = {}  # sparse-attention layer -> its indexer keys [B, T, D_i]

    def length(self) -> int:
        if self.keys:
            return next(iter(self.keys.values())).shape[2]
        return next(iter(self.states.values())).tokens if self.states else 0

    def recurrent_state(self, layer_id: int) -> object | None:
        return self.states.get(layer_id)

    def keep_recurrent_state(self, layer_id: int, state) -> None:
        self.states[layer_id] = state

    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: Window, sinks: torch.Tensor | None = None) -> torch.Tensor:
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
            allowed &= window_allows(q_pos[:, None], k_pos[None, :], window)
        if sinks is not None:  # gpt-oss's sink logits (tessera/models/attention_variants/attention_sinks.py)
            return sink_attention(q_BHSD, k_BGSD, v_BGSD, scale, sinks, allowed)
        gqa = q_BHSD.shape[1] != k_BGSD.shape[1]
        return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, attn_mask=allowed, scale=scale,
                                              enable_gqa=gqa)

    def attend_sparse(self, layer_id: int, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                      scale: float, index_keys_BSD: torch.Tensor, choose: KeyChoice) -> torch.Tensor:
        """MLA over the keys `choose` picks among every cached one (tessera/models/attention_variants/sparse_mla.py)."""
        if layer_id in self.index_keys:
            index_keys_BSD = torch.cat([self.index_keys[layer_id], index_keys_BSD], dim=1)
        self.index_keys[layer_id] = index_keys_BSD
        if layer_id in self.keys:
            k_BHSD = torch.cat([self.keys[layer_id], k_BHSD], dim=2)
            v_BHSD = torch.cat([self.values[layer_id], v_BHSD], dim=2)
        self.keys[layer_id], self.values[layer_id] = k_BHSD, v_BHSD
        S, T = q_BHSD.shape[2], k_BHSD.shape[2]
        allowed = torch.ones(S, T, dtype=torch.bool, device=q_BHSD.device).tril(T - S)
        chosen = torch.stack([choose(slice(None), index_keys_BSD[b], allowed)[b] for b in range(q_BHSD.shape[0])])
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask=chosen[:, None], scale=scale)


@torch.no_grad()
def reference_generate(model: Transformer, prompt_ids: list[int], params: SamplingParams,
                       use_cache: bool = True) -> list[int]:
    """The new token ids after `prompt_ids`: at most `params.max_tokens`, ending at one of
    `params.stop_token_ids` (included, as the engine does) or when prompt + completion reach the
    model's `max_seq_len` (the engine's `max_model_len` rule). A sampled request without a seed
    uses seed 0, so the reference is always reproducible."""
    if not prompt_ids:
        raise ValueError("reference_generate needs at least one prompt token")
    model.eval()
    device = next(model.parameters()).device
    seed = params.seed if params.seed is not None else 0
    stop_ids = set(params.stop_token_ids)
    cache = ConcatKVCache() if use_cache else None
    ids = list(prompt_ids)
    pending = ids
    out: list[int] = []
    while len(out) < params.max_tokens and len(ids) < model.cfg.max_seq_len:
        start = cache.length() if cache is not None else 0
        x = torch.tensor([pending if cache is not None else ids], device=device)
        positions = torch.arange(start, start + x.shape[1], device=device)[None]
        logits = model(ModelInput(tokens=x, positions=positions, cache=cache)).logits[0, -1]
        batch = SamplingBatch.build([(params, seed, len(out))], logits.shape[-1], logits.device)
        token = int(sample_on_device(logits[None], batch)[0])
        out.append(token)
        ids.append(token)
        pending = [token]
        if token in stop_ids:
            break
    return out
