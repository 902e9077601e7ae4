"""Sleep level 1 of a serving engine: its KV cache freed, its weights moved to host memory, and both
brought back on waking; and the bytes an engine holds (weights, KV cache), which the model registry
of `tessera serve --model NAME=PATH` counts against its memory budget (tessera/infer/fleet/model_registry.py).

Level 1 works on tensor storages in place: every tensor that views a storage (the KV cache's layers,
the decode step's views of them, a weight and its packed panels) keeps its storage object, whose
bytes are released (`resize_(0)`) and allocated again on waking, so nothing that holds a tensor has
to be rebuilt. The KV cache comes back zeroed (its int8 scales at one) and the prefix cache empty:
what the blocks held is gone, so no lookup may find it. Weights on an accelerator are copied to host
memory first and copied back on waking. On the CPU the weights already are host memory: level 1
there frees the KV cache and leaves the weights where they are (the registry keeps counting them).
The freed pages then go back to the kernel (`release_freed_memory`, glibc's `malloc_trim`): `tessera
serve` on the CPU tells the allocator to keep freed memory (tessera/infer/cpu/memory.py), which
would otherwise hold every KV store below 32 MiB in the process while the model sleeps.
An engine sleeps only when idle (no request queued or running), runs one process (no tensor
parallelism, whose other ranks hold their own shards) and, off the CPU, replays no captured CUDA
graphs (they hold the old addresses); `check_can_sleep` refuses the others, which the registry puts
to level 2 instead. Off the CPU this path is written and not yet run (no GPU here).
Level 2 (weights dropped, read again from their files) is the registry's: it closes the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.config.errors import ConfigError
from tessera.infer.cpu.memory import release_freed_memory
from tessera.infer.engine.llm_engine import LLMEngine


def _tensors_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor `module` holds: parameters, buffers and tensors kept as plain attributes (the CPU
    kernels' packed panels)."""
    found = []
    for m in module.modules():
        found += [t for t in m._parameters.values() if t is not None]
        found += [t for t in m._buffers.values() if t is not None]
        found += [t for t in vars(m).values() if isinstance(t, torch.Tensor)]
    return found


def _storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors` (a tied weight counted once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr() or id(s), s)
    return list(seen.values())


def weight_tensors(engine: LLMEngine) -> list[torch.Tensor]:
    modules = [engine.model] + ([engine.vision] if engine.vision is not None else [])
    return [t for m in modules for t in _tensors_of(m)]


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of the served model's weights (and a vision-language model's tower), each storage once."""
    return sum(s.nbytes() for s in _storages(weight_tensors(engine)))


def kv_bytes(engine: LLMEngine) -> int:
    """Bytes of the engine's paged KV cache on its device (0 while it sleeps)."""
    return sum(s.nbytes() for s in _storages(engine.kv.stores()))


def level1_supported(engine: LLMEngine) -> bool:
    """One process, and no captured CUDA graphs (they hold the addresses of the storages that level 1
    allocates again): on the CPU, or with --enforce-eager."""
    on_cpu = torch.device(engine.config.device).type == "cpu"
    return engine.config.tensor_parallel_size == 1 and (on_cpu or engine.config.enforce_eager)


def check_can_sleep(engine: LLMEngine) -> None:
    if not level1_supported(engine):
        raise ConfigError("sleep level 1 needs tensor_parallel_size=1 and, off the CPU, enforce_eager (decode "
                          "graphs hold the cache's addresses); level 2 closes the engine instead")
    if engine.has_unfinished():
        raise ConfigError("the engine has requests queued or running; it sleeps once they finish")


@dataclass
class SleptEngine:
    """What an engine put to sleep at level 1 needs to wake: each KV store's size and fill value,
    and each weight storage's host copy (none on the CPU)."""

    kv: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    weights: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = field(default_factory=list)


def sleep_level1(engine: LLMEngine) -> SleptEngine:
    """Free the engine's KV cache and move its weights to host memory (module docstring); in the
    engine thread, between steps (`EngineLoop.call`)."""
    check_can_sleep(engine)
    slept = SleptEngine()
    for store in _storages(engine.kv.stores()):
        slept.kv.append((store, store.nbytes()))
        store.resize_(0)
    getattr(engine.kv, "_workspace", {}).clear()
    engine.blocks.forget_all()
    if torch.device(engine.config.device).type != "cpu":
        for store in _storages(weight_tensors(engine)):
            host = store.cpu()
            store.resize_(0)
            slept.weights.append((store, host))
    release_freed_memory()  # the KV cache's pages back to the kernel, not kept for the next step
    return slept


def wake_level1(engine: LLMEngine, slept: SleptEngine) -> None:
    """Undo `sleep_level1`: weights copied back, the KV cache allocated again (zeros, int8 scales one)
    and the system prompts cached again."""
    for store, host in slept.weights:
        store.resize_(host.nbytes())
        store.copy_(host)
    for store, nbytes in slept.kv:
        store.resize_(nbytes)
    kv = engine.kv
    for t in (*kv.k, *kv.v, *kv.index_k):
        t.zero_()
    for t in (*getattr(kv, "k_scale", []), *getattr(kv, "v_scale", [])):
        t.fill_(1.0)
    engine.warm_system_prompts(engine.config.system_prompts)
