"""Global batches in a seeded order, with a position that checkpoints save and restore exactly.

`BatchIterator` walks a sample dataset in a fresh seeded permutation per epoch (from
`default_rng([seed, epoch])`: the seed and epoch are mixed by NumPy's SeedSequence, so that
seed 1 epoch 0 and seed 0 epoch 1 do not share an order) and returns the WHOLE global batch each
step: the trainer slices micro-batches and data-parallel ranks out of it, so every parallel
layout trains on exactly the same samples in the same order. A batch that reaches the end of an
epoch continues into the next, so no sample is ever skipped.

The position is two integers (epoch, index within the epoch's order); `state_dict()` returns it
with what it depends on, and `load_state_dict()` refuses a state taken on other data or another
seed, since resuming there could not reproduce the batches. The position counts samples, not
batches, so a run may resume with another global batch size and continue where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tessera.config.errors import DataError
from tessera.data.sampling import Sample, SampleDataset

STATE_FORMAT = "tessera.data.BatchIterator/1"


@dataclass
class Batch:
    """`tokens`: int64 `[B, seq_len + 1]`; `loss_mask`: bool, same shape, True where a token counts.

    A model reads `inputs` and is scored on `targets` where `target_mask` is True. `pixel_values`:
    a vision-language batch's images, one float32 tensor per row in the order of the row's image
    placeholders: LLaVA's `[N_i, C, H, W]` (N_i may be 0), Qwen2-VL's patch rows `[P_i, C x T x
    p^2]` of its images together, with `image_grid_thw` `[N_i, 3]` per row beside them (each
    image's patch grid, which decides its size and positions); None for text (grids: None but Qwen's).
    A batch of preference pairs (tessera.data.preference) holds `tokens` and `loss_mask` of
    [B, 2, seq_len + 1], each pair's chosen then rejected sequence; the DPO mode reads them as such.
    A batch of prompts (tessera.data.prompts) holds each prompt's ids in `tokens` (`loss_mask` True on
    them) and its JSONL record in `records`, which the GRPO mode hands to the reward; None otherwise.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    pixel_values: list[torch.Tensor] | None = None
    image_grid_thw: list[torch.Tensor] | None = None
    records: list[dict] | None = None

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.tokens[:, 1:]

    @property
    def target_mask(self) -> torch.Tensor:
        return self.loss_mask[:, 1:]


def collate(samples: list[Sample]) -> Batch:
    """Stack samples into a batch; a sample without a mask counts every token."""
    tokens = np.stack([s.tokens for s in samples]).astype(np.int64, copy=False)
    mask = np.stack([np.ones(len(s.tokens), dtype=bool) if s.loss_mask is None else s.loss_mask
                     for s in samples])
    # vision-language samples (tessera.data.vision_sft.VisionSample) carry their images
    pixels = [torch.from_numpy(s.pixels) for s in samples] if hasattr(samples[0], "pixels") else None
    grids = ([torch.from_numpy(s.grids) for s in samples] if getattr(samples[0], "grids", None) is not None
             else None)
    records = [s.record for s in samples] if hasattr(samples[0], "record") else None  # prompts (GRPO)
    return Batch(tokens=torch.from_numpy(tokens), loss_mask=torch.from_numpy(mask), pixel_values=pixels,
                 image_grid_thw=grids, records=records)


class BatchIterator:
    """Endless global batches of `dataset` in seeded per-epoch order (unshuffled with `shuffle=False`)."""

    def __init__(self, dataset: SampleDataset, global_batch_size: int, seed: int = 0, *,
                 shuffle: bool = True):
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be at least 1, got {global_batch_size}")
        if len(dataset) == 0:
            raise DataError(f"cannot draw batches from an empty dataset: {dataset!r}")
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.index = 0  # position within the current epoch's order
        self.samples_seen = 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample indices of `epoch`, in the order they are drawn."""
        if epoch != self._order_epoch:
            n = len(self.dataset)
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                           else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> list[int]:
        """Advance by one global batch and return the sample indices it holds."""
        indices: list[int] = []
        n = len(self.dataset)
        while len(indices) < self.global_batch_size:
            if self.index == n:
                self.epoch, self.index = self.epoch + 1, 0
            take = min(self.global_batch_size - len(indices), n - self.index)
            indices.extend(int(i) for i in self.epoch_order(self.epoch)[self.index:self.index + take])
            self.index += take
        self.samples_seen += len(indices)
        return indices

    def next_batch(self) -> Batch:
        return collate([self.dataset[i] for i in self.next_indices()])

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "epoch": self.epoch, "index": self.index,
                "samples_seen": self.samples_seen, "seed": self.seed, "shuffle": self.shuffle,
                "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the next batch is the one that would have followed it."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise DataError(f"not a batch iterator state: format {found!r}, expected {STATE_FORMAT!r}")
        current = {"seed": self.seed, "shuffle": self.shuffle, "num_samples": len(self.dataset)}
        for key, value in current.items():
            if state.get(key) != value:
                raise DataError(f"batch iterator state was saved with {key}={state.get(key)!r} but this "
                                f"iterator has {key}={value!r}; resuming would not reproduce the batches")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self.dataset):
            raise DataError(f"batch iterator state position out of range: epoch={epoch}, index={index}, "
                            f"allowed index 0..{len(self.dataset)}")
        self.epoch, self.index, self.samples_seen = epoch, index, int(state["samples_seen"])


def eval_batches(dataset: SampleDataset, batch_size: int, max_batches: int | None = None) -> Iterator[Batch]:
    """Every sample of `dataset` once, in order, `batch_size` at a time (the last batch may be smaller)."""
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    for count, start in enumerate(range(0, len(dataset), batch_size)):
        if max_batches is not None and count >= max_batches:
            return
        yield collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
