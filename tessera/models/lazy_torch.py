"""The parts of torch a one-process server never needs, kept unloaded: DTensor and torch._dynamo.

Importing `torch.distributed.tensor` or `torch._dynamo` brings sympy and torch's symbolic shapes with
them: about 70 MiB of resident memory together and seconds of start-up, which `tessera serve` on one
rank would carry for nothing (issue 53: its memory against llama.cpp's server). Two things pulled them in:

- Asking whether a tensor is a DTensor. None can exist before `torch.distributed.tensor` is imported,
  so `is_dtensor` looks for the module first; the layers that cut tensors (tessera/parallel, the
  tensor-parallel serving runner) import it themselves.
- Building a model on the meta device. `nn.Embedding` and `nn.Linear` initialise their weights at
  construction, and on meta tensors torch runs its Python references for those calls, each wrapped
  to import torch._dynamo on first use. `on_meta()` is `torch.device("meta")` with the random
  initialisers of meta tensors skipped: they write nothing there anyway, and a loader fills every
  weight afterwards (the model's own arithmetic at construction is kept off meta, as
  `Transformer.reset_rope` does). Giving such a model storage goes through `to_empty` here:
  `nn.Module.to_empty`'s `empty_like` of a meta tensor runs a Python reference that imports them too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


def is_dtensor(t: object) -> bool:
    """Whether `t` is a `torch.distributed.tensor.DTensor` (False while that module is not loaded)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` where it is a DTensor, else `t` itself."""
    return t.to_local() if is_dtensor(t) else t


_FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_}  # what nn.init's initialisers end in


class _MetaInitSkipped(TorchFunctionMode):
    """`torch.nn.init`'s functions, and random fills, called on a meta tensor return it untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if (func in _FILLS or getattr(func, "__module__", None) == "torch.nn.init") \
                and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def to_empty(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """`module.to_empty(device=device)`: every parameter and buffer given uninitialised storage on
    `device`, with its shape, strides and dtype (allocated directly, not `empty_like` of the meta tensor);
    a DTensor (a model cut for tensor parallelism before it has storage) stays one, through `empty_like`."""
    return module._apply(lambda t: torch.empty_like(t, device=device) if is_dtensor(t)
                         else torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, uninitialised (module docstring)."""
    with torch.device("meta"), _MetaInitSkipped():
        yield
