"""Activation offload (`parallel.activation_offload`): what a block saves for backward goes to host
memory during its forward and comes back to the GPU when its backward needs it.

Every tensor an operator of the block saves passes through `torch.autograd.graph.saved_tensors_hooks`
(the mechanism of `torch.autograd.graph.save_on_cpu`): packing copies it into pinned host memory
(on the copy stream's order, non-blocking) and drops the GPU copy; unpacking copies it back. Left on
the GPU: parameters and their casts or views (model state, needed anyway), and what an operator-level
recomputation policy keeps in its own cache (recompute_policy.py: not a saved tensor). With a
recomputation policy the checkpoint's inputs are saved through these hooks too, so they are
offloaded as well; what a checkpoint saves inside its region is not kept at all.

On a CPU device the activations already live in host memory: the trainer refuses the option there
(`apply_activation_offload`), while `offload_blocks` runs the same hooks with a CPU host, so the
mechanism is tested on CPU (the copies are real, the memory they free is not).
Numerics are unchanged: the tensors come back bit for bit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from tessera.config.errors import ConfigError
from tessera.models.parameter_views import derived_from_parameter, parameter_storages


@dataclass
class HostStore:
    """Where offloaded activations go: host memory, pinned on a GPU machine. Counts what went through."""

    pin_memory: bool = False
    packed_bytes: int = 0  # host bytes written so far
    unpacked: int = 0  # tensors brought back so far

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=self.pin_memory)
        host.copy_(t, non_blocking=self.pin_memory)
        self.packed_bytes += host.untyped_storage().nbytes()
        return host

    def unpack(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.unpacked += 1
        return host.to(device, non_blocking=self.pin_memory)


def offload_block(block: nn.Module, store: HostStore) -> None:
    """Run `block`'s forward with its saved tensors packed into `store` (module docstring). A tensor
    saved by several operators (the RoPE tables, a norm's input) is copied once per forward."""
    inner = block.forward

    def offloaded_forward(*args, **kwargs):
        params = parameter_storages(block)
        copies: dict[int, tuple] = {}  # id(tensor) -> (weak reference, version, packed)

        def pack(t: torch.Tensor):
            if derived_from_parameter(t, params):
                return (None, t)
            seen = copies.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] == t._version:
                return seen[2]
            packed = (t.device, store.pack(t))
            copies[id(t)] = (weakref.ref(t), t._version, packed)
            return packed

        def unpack(packed):
            device, t = packed
            return t if device is None else store.unpack(t, device)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return inner(*args, **kwargs)

    block.forward = offloaded_forward
    block.offload = store  # visible to tests and to whoever prints the model


def offload_blocks(model: nn.Module, store: HostStore) -> list[str]:
    """Offload every block of `model` (a whole model or a pipeline stage) into `store`."""
    for block in model.layers.values():
        offload_block(block, store)
    return [f"layers.{key}" for key in model.layers]


def apply_activation_offload(model: nn.Module, device_type: str) -> list[str]:
    """`parallel.activation_offload=true` on a `device_type` device: GPU activations to pinned host memory."""
    if device_type != "cuda":
        raise ConfigError(f"parallel.activation_offload=true is invalid on {device_type}: it moves saved "
                          "activations from GPU memory to host memory, and on a CPU they are in host memory "
                          "already; set parallel.activation_offload=false (or train on a CUDA GPU)")
    return offload_blocks(model, HostStore(pin_memory=True))
