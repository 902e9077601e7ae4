"""Fixed-length training samples packed across document boundaries, and the train/validation split.

GPT-style packing (Radford et al. 2019; also Megatron-LM and nanoGPT): all documents of an indexed
dataset, each already ended by the end-of-document token, form one token stream, and sample `i`
is the `seq_len + 1` tokens starting at token `i * seq_len`. The model reads the first `seq_len`
and predicts the last `seq_len`, so consecutive samples share one token and no token is wasted
on padding. A dataset of `N` tokens has `(N - 1) // seq_len` samples.

Split: the last `valid_fraction` of the samples (rounded half up; at least one when the fraction
is positive) is the validation split, the rest is the training split. Splitting by samples works
for any number of documents, one huge document included; the two splits are disjoint except that
the last token of the last training sample is the first token of the first validation sample.

A sample carries a loss mask when the dataset has one (supervised fine-tuning writes a parallel
`uint8` dataset at `prefix + ".mask"`, see `tessera.data.sft`): `loss_mask[t]` is 1 where token
`t` is an answer token, i.e. where predicting it from the tokens before it counts in the loss.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Protocol

import numpy as np

from tessera.config.errors import DataError
from tessera.data.indexed import IndexedDataset, index_paths

SPLITS = ("train", "valid")


class Sample(NamedTuple):
    """`tokens`: int64 `[seq_len + 1]`; `loss_mask`: bool `[seq_len + 1]`, or None (every token counts)."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None


class SampleDataset(Protocol):
    """What the blender and the batch iterator need: a length and fixed-length samples by index."""

    seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


def mask_prefix(prefix: str | os.PathLike) -> str:
    """Where the loss mask of the dataset at `prefix` lives."""
    return os.fspath(prefix) + ".mask"


def open_loss_mask(prefix: str | os.PathLike, tokens: IndexedDataset) -> IndexedDataset | None:
    """The mask dataset next to `tokens` if there is one, checked to have the same documents."""
    if not index_paths(mask_prefix(prefix))[1].is_file():
        return None
    mask = IndexedDataset(mask_prefix(prefix))
    if len(mask) != len(tokens) or not np.array_equal(mask.offsets, tokens.offsets):
        raise DataError(f"{mask.idx_path}: loss mask does not line up with {tokens.idx_path} "
                        f"({len(mask)} documents / {mask.num_tokens} tokens vs "
                        f"{len(tokens)} / {tokens.num_tokens})")
    return mask


class PackedDataset:
    """One split of the fixed-length samples of an indexed dataset (see the module docstring)."""

    def __init__(self, source: IndexedDataset | str | os.PathLike, seq_len: int, *, split: str = "train",
                 valid_fraction: float = 0.0, loss_mask: IndexedDataset | None = None):
        self.tokens = source if isinstance(source, IndexedDataset) else IndexedDataset(source)
        if loss_mask is None:
            loss_mask = open_loss_mask(self.tokens.prefix, self.tokens)
        elif not np.array_equal(loss_mask.offsets, self.tokens.offsets):
            raise DataError(f"{loss_mask.idx_path}: loss mask does not line up with {self.tokens.idx_path}")
        self.loss_mask = loss_mask
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}")
        if split not in SPLITS:
            raise DataError(f"split {split!r} is not allowed (allowed: {', '.join(SPLITS)})")
        if not 0.0 <= valid_fraction < 1.0:
            raise DataError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
        self.seq_len, self.split = seq_len, split
        total = (self.tokens.num_tokens - 1) // seq_len
        if total < 1:
            raise DataError(f"{self.tokens.prefix}: {self.tokens.num_tokens} tokens are fewer than one "
                            f"sample of seq_len + 1 = {seq_len + 1} tokens")
        num_valid = 0 if valid_fraction == 0 else max(1, int(total * valid_fraction + 0.5))
        if num_valid >= total:
            raise DataError(f"{self.tokens.prefix}: {total} samples of {seq_len + 1} tokens are too few "
                            f"for a validation fraction of {valid_fraction} (the training split would be empty)")
        self.first = 0 if split == "train" else total - num_valid
        self.count = total - num_valid if split == "train" else num_valid

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.count:
            raise IndexError(f"sample {index} out of range ({self.count} {self.split} samples)")
        start = (self.first + index) * self.seq_len
        tokens = np.array(self.tokens.get(start, self.seq_len + 1), dtype=np.int64)
        mask = None
        if self.loss_mask is not None:
            mask = np.array(self.loss_mask.get(start, self.seq_len + 1), dtype=bool)
        return Sample(tokens, mask)

    def __repr__(self) -> str:
        return (f"PackedDataset({self.tokens.prefix!r}, seq_len={self.seq_len}, split={self.split!r}, "
                f"samples={self.count}, loss_mask={self.loss_mask is not None})")
