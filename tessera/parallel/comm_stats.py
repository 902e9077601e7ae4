"""Communication accounting: how many bytes each kind of collective moves, counted at the operator level.

`CollectiveCounter` is a `TorchDispatchMode`: while it is active it sees every collective operator
on the calling thread (and in backward, whose autograd engine carries the mode along), whichever
API issued it:

- the c10d operators behind `torch.distributed.*` (`c10d.allreduce_`, `c10d._allgather_base_`,
  ...): FSDP2's all-gathers and reduce-scatters, the expert all-to-alls, the vocabulary-parallel
  loss, gradient-norm all-reduces, pipeline sends;
- the functional collectives (`_c10d_functional.*`) DTensor issues when it redistributes (TP/SP).
  DTensor arguments are handed back to DTensor (`NotImplemented`) so that the mode sees the
  collectives they turn into, not the DTensor op.

Bytes are the *payload* of one call on one rank, as nccl-tests define a collective's size:

    all_reduce      the reduced tensor                 all_gather    the gathered output
    reduce_scatter  the (unreduced) input              all_to_all    the input this rank sends
    broadcast       the tensor                         send_recv     the tensor sent (receives
                                                                     are not counted: a transfer
                                                                     counts once, at its sender)

The bytes a ring algorithm puts on the wire follow from these (all-reduce 2(n-1)/n x payload,
all-gather and reduce-scatter (n-1)/n x payload). The counter adds per-op Python overhead to
every operator while active, so the trainer only turns it on with `log.comm_stats: true`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")

# c10d operator name -> (kind, index of the argument that holds the payload)
_C10D: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0), "send": ("send_recv", 0),
}
FUNCTIONAL_KINDS: dict[str, str] = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


def collective_payload(namespace: str, name: str, args: tuple) -> tuple[str, int] | None:
    """(kind, payload bytes) of one collective operator call, or None if it is not a counted collective."""
    if namespace == "c10d" and name in _C10D:
        kind, index = _C10D[name]
        return kind, _nbytes(args[index])
    if namespace in FUNCTIONAL_NAMESPACES and name in FUNCTIONAL_KINDS:
        kind = FUNCTIONAL_KINDS[name]
        payload = _nbytes(args[0])
        if kind == "all_gather":
            payload *= int(args[1])  # (input, group_size, group_name): the output is group_size inputs
        return kind, payload
    return None


class CollectiveCounter(TorchDispatchMode):
    """Counts calls and payload bytes per collective kind while active (`with CollectiveCounter() as c:`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run; the collectives it issues come back here
        out = func(*args, **kwargs)
        found = collective_payload(func.namespace, func._overloadpacket.__name__, args)
        if found is not None:
            kind, payload = found
            self.calls[kind] += 1
            self.bytes[kind] += payload
        return out

    def as_vector(self) -> list[int]:
        """[calls of each KIND..., bytes of each KIND...]: the fixed layout the trainer reduces over ranks."""
        return [self.calls[k] for k in KINDS] + [self.bytes[k] for k in KINDS]
