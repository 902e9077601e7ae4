"""Counting the device -> host copies and synchronisations a piece of serving code makes."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.models.test_moe_host_sync import HOST_SYNC_OPS


class HostTransfers(TorchFunctionMode):
    """Counts the tensor methods that copy device data to the host (each one a synchronisation
    on a GPU): `.item()`, `.tolist()`, `.cpu()`, `.numpy()` and Python conversions of a tensor."""

    NAMES = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class DataDependentOps(TorchDispatchMode):
    """Records the aten ops whose output size depends on tensor values (boolean-mask indexing,
    `nonzero`, `masked_select`, ...) or that read a value on the host: on a GPU each one waits for
    every kernel queued before it. `seen` holds the name of every op run, to show it ran at all."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.seen.add(name)
        masks = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if masks or name in HOST_SYNC_OPS:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))
