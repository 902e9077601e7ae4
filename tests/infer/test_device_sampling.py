"""On-device sampling: the counter-based noise is uniform and a pure function of (seed, counter,
token), strictly inside (0, 1), with the bits of its int64 formula; draws follow `processed_probs`
(greedy, temperature, top-k, top-p) row by row in a mixed batch, and never a forbidden token; a
request's tokens do not depend on its neighbours."""

from __future__ import annotations

import torch

from tessera.infer.sampling.device_sampling import SamplingBatch, sample_on_device, uniform_noise, unit_interval
from tessera.infer.sampling.params import SamplingParams
from tessera.infer.sampling.sampler import processed_probs

V = 8


def test_noise_is_uniform_and_keyed_by_seed_and_counter():
    seeds = torch.tensor([0, 1, 2**62 + 5, 0])
    counters = torch.tensor([0, 0, 7, 1])
    u = uniform_noise(seeds, counters, 4096)
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    torch.testing.assert_close(u, uniform_noise(seeds, counters, 4096), rtol=0, atol=0)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[3])  # another seed, another counter
    flat = u.flatten()
    assert abs(flat.mean().item() - 0.5) < 0.01 and abs(flat.var().item() - 1 / 12) < 0.005
    counts = torch.histc(flat, bins=16, min=0, max=1)
    assert (counts - len(flat) / 16).abs().max() < 5 * (len(flat) / 16) ** 0.5


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The mixer written plainly in int64 (unsigned 32-bit values), as the noise is specified."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_noise_has_the_bits_of_the_int64_specification():
    """The [B, V] mix runs in int32 (wrapping products, masked shifts); its uniforms are those of the
    plain int64 formula, bit for bit, for seeds across the 63-bit range."""
    gen = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(0, 2**62, (30,), generator=gen), torch.tensor([0, 2**63 - 1])])
    counters = torch.randint(0, 2**20, (32,), generator=gen)
    mask = 0xFFFFFFFF
    key = _lowbias32(_lowbias32(seeds >> 32) ^ (seeds & mask))
    key = _lowbias32(key ^ _lowbias32((counters + 0x9E3779B9) & mask))
    v = torch.arange(5000)
    bits = _lowbias32(key[:, None] ^ _lowbias32((v * 0x27D4EB2F + 0x165667B1) & mask)[None, :])
    want = ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))
    assert torch.equal(uniform_noise(seeds, counters, 5000), want)


def test_noise_never_reaches_0_or_1_at_the_extreme_bits():
    """The largest 32-bit value once mapped to exactly 1.0 in fp32 (-log(u) = 0: an infinite race for
    an allowed token, NaN for a masked one), once in 2^24 draws per token."""
    u = unit_interval(torch.tensor([0, 1, 2**31, 2**32 - 512, 2**32 - 2, 2**32 - 1]))
    assert bool((u > 0).all()) and bool((u < 1).all()), u.tolist()
    assert bool(torch.isfinite(1.0 / -torch.log(u)).all())
    assert u[-1] > u[2] > u[0]


def _batch(params: list[SamplingParams], seeds: list[int], counters: list[int]) -> SamplingBatch:
    return SamplingBatch.build(list(zip(params, seeds, counters)), V, torch.device("cpu"))


def test_draws_follow_the_processed_distribution():
    logits = torch.log(torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.07, 0.05, 0.03]))
    cases = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=3),
             SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=2.0, top_k=5, top_p=0.8)]
    n = 6000
    for params in cases:
        batch = _batch([params] * n, [11] * n, list(range(n)))  # one request's first n draws
        tokens = sample_on_device(logits.expand(n, V), batch)
        freq = torch.bincount(tokens, minlength=V).float() / n
        want = processed_probs(logits[None], params)[0]
        assert bool((freq[want == 0] == 0).all()), (params, freq)
        torch.testing.assert_close(freq, want, atol=0.025, rtol=0)


def test_mixed_batch_rows_are_independent_of_their_neighbours():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=gen)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=4, seed=5),
              SamplingParams(temperature=1.3, top_p=0.7), SamplingParams(temperature=1.0)]
    seeds, counters = [0, 5, 99, 123], [3, 3, 0, 8]
    together = sample_on_device(logits, _batch(params, seeds, counters))
    assert together[0] == logits[0].argmax()
    for i in range(4):
        alone = sample_on_device(logits[i:i + 1], _batch([params[i]], [seeds[i]], [counters[i]]))
        assert alone.item() == together[i].item()
    other_seed = [sample_on_device(logits[1:2], _batch([params[1]], [s], [3])).item() for s in range(40)]
    assert len(set(other_seed)) > 1  # the seed matters


def test_a_forbidden_token_is_never_drawn_in_a_large_vocabulary():
    """A token at -inf (a grammar's mask, top-k, top-p) has probability 0, and 0 / E must never win the
    race, over 2,000 draws of a 49,152-token vocabulary (with the noise that could reach 1.0, about one
    step in 340 drew a masked token: constrained tool calls met it on SmolLM2's vocabulary)."""
    vocab, allowed = 49_152, 216
    logits = torch.full((vocab,), float("-inf"))
    logits[allowed] = 24.8
    for start in range(0, 2000, 250):
        n = 250
        batch = SamplingBatch.build([(SamplingParams(temperature=0.8), 0, c) for c in range(start, start + n)],
                                    vocab, torch.device("cpu"))
        assert bool((sample_on_device(logits.expand(n, vocab), batch) == allowed).all())
