"""Counting the device -> host copies a piece of serving code makes."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode


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
