"""Sampling a whole batch on the device, with per-request seeds and no host synchronisation.

Every row of the batch has its own temperature, top-k and top-p (tensors, so one set of kernels
serves any mix of requests) and its own seed. Randomness is counter-based: the uniform number
for token v of a request's n-th output is a hash of (seed, n, v), computed with integer tensor
ops on the device (the `lowbias32` mixer of C. Wellons, "Prospecting for hash functions", 2018).
A request's draws therefore depend only on its seed and its own progress, never on the batch it
shares, the device, or the order of steps, and no generator state has to live on the host.

A draw from the processed distribution p is `argmax_v p_v / E_v` with E_v ~ Exp(1) independent
(the exponential race, equivalent to `torch.multinomial`), so sampling is one elementwise pass
and one argmax. Greedy rows take the argmax of the raw logits. The result stays on the device;
the caller moves it to the host once per step (`HostTransfer`).
Shapes: B rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from tessera.infer.sampling.params import SamplingParams

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (products wrap; the mask keeps the low bits)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors: the same bits as `_mix32` (read as unsigned), at half the memory
    traffic of int64. Products wrap to their low 32 bits; each right shift is masked to be logical
    (int32's is arithmetic); the second constant is written as the int32 of the same bits."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (0x846CA68B - (1 << 32))
    return x ^ ((x >> 16) & 0xFFFF)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """32-bit values held in int64 [0, 2^32) as the int32 of the same bits."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


def uniform_noise(seeds_B: torch.Tensor, counters_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] fp32 uniforms in (0, 1), a pure function of (seed, counter, token index). The per-row keys
    and per-token hashes are mixed in int64; their [B, V] mix, the bulk of the work, in int32."""
    key = _mix32(_mix32(seeds_B >> 32) ^ (seeds_B & _MASK32))
    key = _mix32(key ^ _mix32(counters_B + 0x9E3779B9))  # [B]
    v = torch.arange(vocab, device=seeds_B.device, dtype=torch.int64)
    token = _mix32(v * 0x27D4EB2F + 0x165667B1)  # [V]
    return unit_interval(_mix32_int32(_as_int32(key)[:, None] ^ _as_int32(token)[None, :]))  # [B, V]


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit values (int64 in [0, 2^32), or int32 of the same bits) as fp32 in (0, 1), never 0 or 1:
    the top 23 bits and a half, so that every value is exact in fp32's 24-bit mantissa. (With 24 bits,
    (2^24 - 1 + 0.5) / 2^24 rounds to 1.0: -log(u) = 0 then makes the race of `sample_on_device`
    infinite for an allowed token, or NaN for a masked one, which argmax picks: once in 2^24 draws per
    token, so most sampled steps of a large vocabulary had a token chosen at random.)"""
    return (((bits >> 9) & 0x7FFFFF).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingBatch:
    """The per-row settings of one step's sampled rows, as device tensors."""

    temperature_B: torch.Tensor  # fp32; 1 on greedy rows (unused there)
    top_k_B: torch.Tensor  # int64 in 1..V
    top_p_B: torch.Tensor  # fp32 in (0, 1]
    seed_B: torch.Tensor  # int64 in [0, 2^63)
    counter_B: torch.Tensor  # int64: how many tokens the request has produced
    greedy_B: torch.Tensor  # bool
    all_greedy: bool  # host-side knowledge: skip the sampling kernels
    needs_sort: bool  # some row has top-k or top-p

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, int, int]], vocab: int, device: torch.device) -> SamplingBatch:
        """`rows`: (params, seed, counter) per sampled row."""
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        greedy = [p.greedy for p, _, _ in rows]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p, _, _ in rows]
        return cls(col([1.0 if p.greedy else p.temperature for p, _, _ in rows], torch.float32),
                   col(top_k, torch.int64), col([p.top_p for p, _, _ in rows], torch.float32),
                   col([s for _, s, _ in rows], torch.int64), col([c for _, _, c in rows], torch.int64),
                   col(greedy, torch.bool), all(greedy),
                   any(not g and (k < vocab or p.top_p < 1.0) for g, k, (p, _, _) in zip(greedy, top_k, rows)))


def sample_on_device(logits_BV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [B] (int64, on the logits' device): argmax for greedy rows, otherwise a draw from
    softmax(logits / T) cut to the top-k tokens and the top-p nucleus (the same distribution as
    `sampling.processed_probs`)."""
    greedy_B = logits_BV.argmax(-1)
    if batch.all_greedy:
        return greedy_B
    logits = logits_BV.float() / batch.temperature_B[:, None]
    if batch.needs_sort:
        sorted_BV, order_BV = logits.sort(dim=-1, descending=True)
        kth = sorted_BV.gather(1, (batch.top_k_B - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
        sorted_BV = sorted_BV.masked_fill(sorted_BV < kth, float("-inf"))
        sorted_p = torch.softmax(sorted_BV, dim=-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
        drop_sorted = mass_before >= batch.top_p_B[:, None]  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order_BV, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    race = probs / -torch.log(uniform_noise(batch.seed_B, batch.counter_B, logits.shape[-1]))
    return torch.where(batch.greedy_B, greedy_B, race.argmax(-1))


def tokens_to_host(values_B: torch.Tensor) -> list[int]:
    """The one device -> host transfer of a decode step (new token ids and finiteness flags)."""
    return values_B.tolist()


class HostTransfer:
    """Integer values of one step, gathered on the device for its one device -> host transfer and
    read back by key: each value of a part comes with the key it is filed under (the values filed
    under one key come back in the order they were added)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.keys: list[Hashable] = []

    def add(self, values_N: torch.Tensor, keys: list[Hashable]) -> None:
        """`values_N` (int64, one per key) to bring over; nothing when `keys` is empty."""
        if keys:
            self.parts.append(values_N)
            self.keys += keys

    def fetch(self) -> dict[Hashable, list[int]]:
        """The values by key, through one transfer (none when nothing was added)."""
        if not self.parts:
            return {}
        out: dict[Hashable, list[int]] = {}
        for key, value in zip(self.keys, tokens_to_host(torch.cat(self.parts))):
            out.setdefault(key, []).append(value)
        return out
