"""Weighted blending of several sample datasets into one, by a deterministic interleave.

Blended sample `j` comes from dataset `d(j)`, chosen so that at every prefix of the blend each
dataset's count stays within one of its share: `|count_d(n) - w_d * n| < 1` for all `n` (the
"quota" property of apportionment, Balinski & Young 1975). The schedule is earliest-deadline-first
over unit jobs: the `m`-th pick of dataset `d` may happen at slot `floor(m / w_d) + 1` at the
earliest and must happen by slot `ceil((m + 1) / w_d)`; these windows always admit a schedule
(Tijdeman 1980, "The chairman assignment problem") and EDF finds one. Weights are turned into
exact fractions so the guarantee survives floating point.

Within each dataset, picks walk through a seeded permutation of its samples, a fresh one per
pass (`default_rng([seed, d, pass])`), so a small dataset with a large weight is repeated in a
new order each time instead of repeating the same sample run.

The blend's length (`num_samples`) defaults to one blended epoch: the fewest samples in which
every dataset with a positive weight contributes each of its samples at least once, i.e.
`max_d ceil(len_d / w_d)` (the total length when the weights are proportional to the sizes). A
shorter blend, repeated epoch after epoch, would never show some samples of an under-weighted
dataset. The index arrays cost 12 bytes per blended sample, and the schedule a few heap operations
of a Python loop per sample, when the blend is built.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from tessera.config.errors import DataError
from tessera.data.sampling import PackedDataset, Sample, SampleDataset


def _exact_weights(weights: Sequence[float]) -> list[Fraction]:
    """Weights as exact fractions summing to 1 (`0.3` means 3/10, as written)."""
    try:
        fractions = [Fraction(w) if isinstance(w, int) else Fraction(str(float(w))) for w in weights]
    except (TypeError, ValueError) as error:
        raise DataError(f"blend weights must be numbers, got {list(weights)}") from error
    if any(f < 0 for f in fractions) or sum(fractions) <= 0:
        raise DataError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    total = sum(fractions)
    return [f / total for f in fractions]


MAX_DEFAULT_SAMPLES = 100_000_000  # ~1.2 GB of index arrays; beyond it num_samples must be given


def blended_epoch_length(weights: Sequence[float], lengths: Sequence[int]) -> int:
    """The fewest blended samples in which each dataset of positive weight shows all its samples."""
    return max(math.ceil(n / w) for w, n in zip(_exact_weights(weights), lengths) if w > 0)


def blend_schedule(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """Which dataset each of the first `num_samples` blended samples comes from (int32 array)."""
    exact = _exact_weights(weights)
    scale = math.lcm(*(f.denominator for f in exact))
    share = [int(f * scale) for f in exact]  # integer weights; slot n has weight-time n * scale

    def window(d: int, m: int) -> tuple[int, int]:
        release = m * scale // share[d] + 1
        deadline = -(-(m + 1) * scale // share[d])
        return release, deadline

    pending = [(window(d, 0)[0], d) for d in range(len(share)) if share[d] > 0]
    heapq.heapify(pending)
    ready: list[tuple[int, int]] = []
    picks = [0] * len(share)
    schedule = np.empty(num_samples, dtype=np.int32)
    for slot in range(1, num_samples + 1):
        while pending and pending[0][0] <= slot:
            _, d = heapq.heappop(pending)
            heapq.heappush(ready, (window(d, picks[d])[1], d))
        _, d = heapq.heappop(ready)  # never empty: the windows are feasible
        schedule[slot - 1] = d
        picks[d] += 1
        heapq.heappush(pending, (window(d, picks[d])[0], d))
    return schedule


class BlendedDataset:
    """`datasets` mixed in proportion to `weights`; `num_samples` defaults to one blended epoch."""

    def __init__(self, datasets: Sequence[SampleDataset], weights: Sequence[float], seed: int = 0,
                 num_samples: int | None = None):
        if not datasets or len(datasets) != len(weights):
            raise DataError(f"blending needs one weight per dataset, got {len(datasets)} datasets "
                            f"and {len(weights)} weights")
        seq_lens = {d.seq_len for d in datasets}
        if len(seq_lens) != 1:
            raise DataError(f"blended datasets must share seq_len, got {sorted(seq_lens)}")
        empty = [i for i, (d, w) in enumerate(zip(datasets, weights)) if len(d) == 0 and w > 0]
        if empty:
            raise DataError(f"blended datasets {empty} have no samples but a positive weight")
        self.datasets, self.weights, self.seed = list(datasets), list(weights), seed
        self.seq_len = seq_lens.pop()
        if num_samples is None:
            num_samples = blended_epoch_length(weights, [len(d) for d in datasets])
            if num_samples > MAX_DEFAULT_SAMPLES:
                raise DataError(f"with weights {list(weights)} every dataset is covered only after "
                                f"{num_samples} blended samples; pass num_samples (e.g. steps x batch size)")
        self.num_samples = num_samples
        if self.num_samples < 1:
            raise DataError(f"a blended dataset needs at least one sample, "
                            f"got num_samples={self.num_samples}")
        self.dataset_index = blend_schedule(weights, self.num_samples)
        self.sample_index = np.empty(self.num_samples, dtype=np.int64)
        for d, dataset in enumerate(self.datasets):
            positions = np.flatnonzero(self.dataset_index == d)
            if positions.size:
                passes = -(-positions.size // len(dataset))
                order = np.concatenate([np.random.default_rng([seed, d, p]).permutation(len(dataset))
                                        for p in range(passes)])
                self.sample_index[positions] = order[:positions.size]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range ({self.num_samples} blended samples)")
        return self.datasets[self.dataset_index[index]][int(self.sample_index[index])]

    def __repr__(self) -> str:
        return (f"BlendedDataset({len(self.datasets)} datasets, weights={self.weights}, "
                f"samples={self.num_samples})")


def build_split_dataset(prefixes: Sequence[str | os.PathLike], seq_len: int, split: str = "train", *,
                        weights: Sequence[float] | None = None, valid_fraction: float = 0.0,
                        seed: int = 0) -> SampleDataset:
    """The `split` of one indexed dataset, or the blend of the same split of several.

    Without `weights`, several datasets are mixed in proportion to their number of samples.
    """
    if isinstance(prefixes, (str, os.PathLike)):
        prefixes = [prefixes]
    parts = [PackedDataset(p, seq_len, split=split, valid_fraction=valid_fraction) for p in prefixes]
    if len(parts) == 1 and weights is None:
        return parts[0]
    return BlendedDataset(parts, weights if weights is not None else [len(p) for p in parts], seed)
