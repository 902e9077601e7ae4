"""Kept expert exchanges (`parallel.recompute_save` names `dispatch`, under `recompute=op`): the MoE
all-to-alls of a block's forward keep what they received, and the block's replay in backward takes it
from there instead of sending again.

Without it a recomputed MoE block exchanges its rows three times per micro-batch and layer (forward,
replay, and the gradients' transposes in backward: 6 row all-to-alls and 2 count exchanges); with it
twice (4 row all-to-alls, the count exchange once), as DeepSeek-V3 runs (arXiv 2412.19437, section 3.2:
the dispatched tokens are kept, backward sends only the gradients).

A block's forward runs its exchanges in one order and its replay runs the same ones in the same order
(the checkpoint relies on it), so a record is a list: the forward appends each exchange's output, the
replay takes them back in turn. The row exchanges stay autograd functions in the replay (`kept_rows`),
so what follows them saves the same tensors as in the forward; their backward is never the one that
runs (non-reentrant checkpointing replays only to rebuild saved tensors; the forward's graph, whose
all-to-alls send the gradients, is the one backward walks). The count exchange also keeps what this rank
sent: a replay that routes differently from its forward is refused, not silently mixed.

The record is per thread: DualPipeV's overlapped pairs run a forward on one thread and another
micro-batch's replay on the other (pipeline_overlap.py), each inside its own record.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tessera.config.errors import ParallelError

_active = threading.local()


class ExchangeRecord:
    """One forward's kept exchanges, in order; `observers` see every kept tensor (the planner's tests
    count them)."""

    def __init__(self, observers: list[Callable[[torch.Tensor], None]] | None = None, *,
                 pack: Callable | None = None, unpack: Callable | None = None):
        self.kept: list[object] = []
        self.position = 0
        self.observers = observers if observers is not None else []
        # the received rows' storage (FP8 rows with their scales: `activation_fp8: [dispatch]`) and back
        self.pack, self.unpack = pack, unpack

    def keep(self, entry: object, *tensors: torch.Tensor) -> None:
        self.kept.append(entry)
        for t in tensors:
            for observe in self.observers:
                observe(t)

    def take(self) -> object:
        if self.position >= len(self.kept):
            raise ParallelError("the MoE block's replay exchanged more than its forward: a kept dispatch "
                                "(recompute_save: dispatch) needs the replay to run the forward's exchanges")
        entry = self.kept[self.position]
        self.position += 1
        return entry


class Keeping:
    """Context of one forward (`replay=False`) or of its replay (`replay=True`) on this thread."""

    def __init__(self, record: ExchangeRecord, replay: bool):
        self.record, self.replay = record, replay
        self.before: tuple | None = None

    def __enter__(self):
        self.before = getattr(_active, "state", None)
        if self.replay:  # a split backward replays the block once per pass, each from the first exchange
            self.record.position = 0
        _active.state = (self.record, self.replay)
        return self

    def __exit__(self, *exc):
        _active.state = self.before
        return False


def current() -> tuple[ExchangeRecord, bool] | None:
    """(record, replaying) of the block this thread runs under a kept dispatch, else None."""
    return getattr(_active, "state", None)


class _KeptRows(torch.autograd.Function):
    """The replay's row exchange: the forward's received rows, as an output of `x` (so what follows
    requires gradients and saves tensors as in the forward). Its backward never runs (module docstring)."""

    @staticmethod
    def forward(ctx, x, kept: Callable[[], torch.Tensor]):
        with _disable_current_modes():  # not operators the forward ran: the checkpoint's cache must not see them
            rows = kept()
            return rows.view_as(rows)

    @staticmethod
    def backward(ctx, g):
        raise ParallelError("a kept expert exchange's replay output was differentiated: only the forward's "
                            "all-to-all sends gradients")


def exchange_rows(x: torch.Tensor, send: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`send(x)` (an all-to-all of rows), kept in a forward and taken back in its replay."""
    state = current()
    if state is None:
        return send(x)
    record, replay = state
    if replay:
        entry = record.take()
        return _KeptRows.apply(x, lambda: entry if record.unpack is None else record.unpack(*entry))
    out = send(x)
    with _disable_current_modes():  # bookkeeping, not the block's: the replay does not run it
        kept = out.detach()
        entry = kept if record.pack is None else (*record.pack(kept), kept.dtype)
    record.keep(entry, *(entry if isinstance(entry, tuple) else (entry,))[:2])
    return out


def exchange_counts(send_counts: torch.Tensor, send: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`send(send_counts)` (the count all-to-all), kept in a forward and taken back in its replay,
    which must send the same counts."""
    state = current()
    if state is None:
        return send(send_counts)
    record, replay = state
    if not replay:
        received = send(send_counts)
        with _disable_current_modes():
            sent = send_counts.clone()
        record.keep((sent, received), sent, received)
        return received
    sent, received = record.take()
    with _disable_current_modes():
        same = torch.equal(sent, send_counts)
    if not same:
        raise ParallelError("the MoE block's replay routed differently from its forward (the rows per expert "
                            "changed), so the kept dispatch does not apply: keep the router (recompute_save)")
    return received
