"""Measure the activation memory the estimator predicts: bytes autograd saves for backward.

    with SavedTensorCounter(model) as counter:
        loss = loss_fn(model(ids))
    counter.total_bytes

Every tensor an op saves for backward passes through `torch.autograd.graph.saved_tensors_hooks`.
The counter keeps one entry per storage (a tensor saved by two ops, or two views of one buffer,
count once, at the storage's full size) and leaves out parameters and anything derived from a
parameter by casts and views alone (autocast's bf16 weight copies), which memory.py counts as
model state. Tensors saved inside a non-reentrant `torch.utils.checkpoint` region go to the
checkpoint's own hooks and are not seen, exactly as they are not kept; the region's inputs are.
Only storages still held when the context exits count: an op whose output nobody uses (the
top-k that only chooses experts, for instance) is freed with what it saved before backward.

Two more ways a trainer keeps activations, both counted: the outputs an operator-level policy
(`parallel.recompute=op`) keeps in its cache instead of saving them for backward, which every
block's `recompute_policy` shows to its observers (tessera/parallel/memory/recompute_policy.py), and
nothing of what the activation offload moves to host memory (its hooks sit inside the blocks, so
what they pack never reaches this counter: it counts device memory).
This is the measurement `activation_terms` is tested against (tests/plan).
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.models.parameter_views import derived_from_parameter, parameter_storages


@dataclass
class SavedEntry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # of the whole storage
    where: str  # innermost tessera source line that saved it
    refs: list = field(default_factory=list, repr=False)  # weak references to the saved tensors

    @property
    def alive(self) -> bool:
        return any(r() is not None for r in self.refs)


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/tessera/" in f.filename and "saved_tensors" not in f.filename]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"


class SavedTensorCounter:
    """Context manager counting the bytes of distinct storages saved for backward."""

    def __init__(self, model: nn.Module | None = None, record_sources: bool = False):
        self._params = set()
        self._model = model
        if model is not None:
            self._params = parameter_storages(model)
        self._record_sources = record_sources
        self.entries: dict[int, SavedEntry] = {}
        self.kept: list[SavedEntry] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _policies(self) -> list:
        return [m.recompute_policy for m in self._model.modules() if hasattr(m, "recompute_policy")] \
            if self._model is not None else []

    def _keep(self, t: torch.Tensor) -> None:
        """An output a policy keeps in its cache (module docstring): alive until its backward."""
        self._pack(t)
        self.entries[t.untyped_storage().data_ptr()].refs.append(lambda t=t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if derived_from_parameter(t, self._params):
            return t
        entry = self.entries.get(key)
        if entry is None or not entry.alive:  # new, or an address freed and reused since
            where = _caller() if self._record_sources else ""
            entry = self.entries[key] = SavedEntry(tuple(t.shape), t.dtype, storage.nbytes(), where)
        entry.refs.append(weakref.ref(t))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorCounter:
        for policy in self._policies():
            policy.observers.append(self._keep)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        for policy in self._policies():
            policy.observers.remove(self._keep)
        self.kept = [e for e in self.entries.values() if e.alive]

    @property
    def total_bytes(self) -> int:
        """Bytes of the distinct storages still saved when the context exited."""
        return sum(e.nbytes for e in self.kept)

    def by_source(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.kept:
            out[e.where] = out.get(e.where, 0) + e.nbytes
        return out
