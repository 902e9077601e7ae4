"""The models of `tessera serve --model NAME=PATH [--model ...]`: each one's engine, awake or asleep,
within a memory budget.

A model is awake (level 0: its engine thread running, weights and KV cache in place) or asleep:
level 1 (KV cache freed, weights moved to host memory, tessera/infer/engine/sleep.py; on the CPU the
weights stay where they are, the KV cache alone is freed) or level 2 (the engine closed: weights and
KV cache dropped, read again from PATH on waking). A model goes to sleep, at the registry's level,
when it has been idle longer than `keep_alive_s`, when another model needs its room under the
budget (least recently used first), or when asked (POST /sleep). A request to a sleeping model
wakes it and waits for it, at most `wake_timeout_s`; requests that arrive meanwhile wait for the
same wake. A model that cannot be loaded or woken (its files gone, say) fails its own requests
with the reason (503) and leaves the others serving; its next request tries again.

The budget counts what each model holds (`resident_bytes`): weights and KV cache while awake, the
weights alone at level 1 on the CPU (the host copy is the same memory there), nothing at level 2.
A model is measured when it first loads (at start, one at a time, each put to level 2 before the
next loads, so that the budget holds while loading too); one larger than the whole budget is
refused at start, by name. Sleeps and wakes run one at a time (`_lock`); a request to an awake model
takes no lock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tessera.config.errors import ConfigError
from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.api.quoting import brief
from tessera.infer.cpu.memory import release_freed_memory
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.engine.sleep import (
    SleptEngine,
    kv_bytes,
    level1_supported,
    sleep_level1,
    wake_level1,
    weight_bytes,
)
from tessera.infer.fleet.model_adapters import owners, qualified_names

log = logging.getLogger("tessera.serve")
GIB = 2**30


class WakeFailed(Exception):
    """A model could not be loaded or woken; its message says why, in one line."""


@dataclass
class ServedModel:
    name: str
    path: str
    cpu: bool  # served on the CPU: level 1 leaves its weights in (host) memory
    level: int = 2  # 0 awake, 1 or 2 asleep (2 until first loaded)
    loop: EngineLoop | None = None
    app: Any = None  # the ASGI app over `loop` (tessera/infer/api/server.py's create_app)
    slept: SleptEngine | None = None
    task: asyncio.Task | None = None  # the sleep or wake under way
    weights: int = 0  # bytes, measured at the first load
    kv: int = 0
    in_flight: int = 0
    waiting: int = 0  # requests in `acquire`, about to run on it once it is awake
    last_used: float = field(default_factory=time.monotonic)
    requests: int = 0
    wakes: int = 0
    wake_seconds: float = 0.0
    last_wake_seconds: float = 0.0
    tokens: list[int] = field(default_factory=lambda: [0, 0])  # prompt, generated, of engines closed since
    error: str | None = None  # why the last load or wake failed
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters served on it, name -> PEFT directory

    def resident_bytes(self) -> int:
        if self.level == 0:
            return self.weights + self.kv
        return self.weights if self.level == 1 and self.cpu else 0

    @property
    def state(self) -> str:
        return "awake" if self.level == 0 else "asleep"

    def token_counts(self) -> tuple[int, int]:
        m = self.loop.engine.metrics if self.loop is not None else None
        return (self.tokens[0] + (m.prompt_tokens if m else 0), self.tokens[1] + (m.generation_tokens if m else 0))


def parse_model_option(text: str) -> tuple[str, str]:
    """`NAME=PATH` of one --model; ConfigError naming what is wrong."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise ConfigError(f"--model {text!r} is invalid: give NAME=PATH (the name requests use, then a model "
                          "directory, run directory or GGUF file)")
    return name.strip(), path


class ModelRegistry:
    """The served models (module docstring). `load(path, adapters)` builds a model's engine thread
    with its LoRA adapters (name -> directory; raising on failure), `make_app(loop, name)` the app that
    serves it; `adapters`: each model's (model_adapters.py)."""

    def __init__(self, models: dict[str, str], load: Callable[[str], EngineLoop], make_app: Callable[..., Any],
                 budget_gib: float, keep_alive_s: float = 300.0, sleep_level: int = 1, wake_timeout_s: float = 300.0,
                 cpu: bool = True, adapters: dict[str, dict[str, str]] | None = None):
        if not models:
            raise ConfigError("--model NAME=PATH is needed at least once")
        if not budget_gib > 0:
            raise ConfigError(f"--memory-budget-gib {budget_gib} is invalid: must be > 0")
        if sleep_level not in (1, 2):
            raise ConfigError(f"--sleep-level {sleep_level} is invalid: allowed 1 or 2")
        self.models = {name: ServedModel(name, path, cpu, adapters=dict((adapters or {}).get(name, {})))
                       for name, path in models.items()}
        self.load_engine, self.make_app = load, make_app
        self.budget, self.budget_gib = int(budget_gib * GIB), budget_gib
        self.keep_alive_s, self.sleep_level, self.wake_timeout_s = keep_alive_s, sleep_level, wake_timeout_s
        self._lock = asyncio.Lock()
        self._keeper: asyncio.Task | None = None

    # ---- start and stop ------------------------------------------------------------------------
    def start(self) -> None:
        """Load and measure each model, one at a time; the last one stays awake (if it fits). A model
        larger than the budget is refused (ConfigError naming it); one that fails to load is kept,
        asleep, with its error (its requests fail alone)."""
        names = list(self.models)
        for k, name in enumerate(names):
            model = self.models[name]
            try:
                self._load(model)
            except Exception as e:  # noqa: BLE001 - any failure to load fails this model's requests alone
                model.error = _one_line(e)
                log.error("model %s failed to load: %s", name, model.error)
                continue
            if model.weights + model.kv > self.budget:
                self._close(model)
                self.close()
                raise ConfigError(f"--memory-budget-gib {self.budget_gib:g} is smaller than model {name!r} "
                                  f"({(model.weights + model.kv) / GIB:.3f} GiB of weights and KV cache); raise "
                                  "the budget, lower --kv-cache-gib or serve the model elsewhere")
            if k < len(names) - 1:
                self._close(model)

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
        for model in self.models.values():
            if model.loop is not None:
                self._close(model)

    def _load(self, model: ServedModel) -> None:
        """A fresh engine for `model` from its files (in a worker thread when serving)."""
        started = time.perf_counter()
        model.loop = self.load_engine(model.path, model.adapters)
        engine = model.loop.engine
        model.weights, model.kv = weight_bytes(engine), kv_bytes(engine)
        model.app = self.make_app(model.loop, model.name)
        model.level, model.slept, model.error = 0, None, None
        model.last_wake_seconds = time.perf_counter() - started

    def _close(self, model: ServedModel) -> None:
        """Level 2: the engine stopped and dropped."""
        loop = model.loop
        prompt, generated = model.token_counts()
        model.tokens = [prompt, generated]
        model.loop, model.app, model.slept, model.level = None, None, None, 2
        if loop is not None:
            loop.stop()
            loop.engine.close()
        del loop
        _forget_endpoint_callables()
        gc.collect()
        release_freed_memory()  # its weights back to the kernel (tessera serve keeps freed pages otherwise)

    # ---- requests ------------------------------------------------------------------------------
    def lookup(self, name: Any) -> ServedModel:
        """The model a request's `model` names, itself or one of its adapters (model_adapters.py): 404
        naming the served ones, 400 for an adapter's name that several models have."""
        adapters = {m.name: m.adapters for m in self.models.values()}
        served = [*self.models, *qualified_names(adapters)]
        if not isinstance(name, str):
            raise ProtocolError(f"'model' must be one of {served}", param="model",
                                status=400 if name is not None else 404)
        if name in self.models:
            return self.models[name]
        found = owners(name, adapters)
        if len(found) > 1:
            raise ProtocolError(f"model {brief(name)} is an adapter of several models: name one of "
                                f"{[f'{m}:{name}' for m in found]}", param="model")
        if not found:
            raise ProtocolError(f"model {brief(name)} does not exist; served: {served}", status=404, param="model")
        return self.models[found[0]]

    async def acquire(self, model: ServedModel, count: bool = True) -> ServedModel:
        """`model` awake, with this request counted in flight (`release` when done); a sleeping one
        woken first, within `wake_timeout_s` (503 past it, or naming why the wake failed)."""
        deadline = time.monotonic() + self.wake_timeout_s
        model.waiting += 1  # a model just woken for its waiters is not another wake's to evict (_make_room)
        try:
            while not (model.level == 0 and model.task is None):
                if model.task is None:
                    model.task = asyncio.ensure_future(self._transition(model, self._wake(model)))
                try:
                    await asyncio.wait_for(asyncio.shield(model.task), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise ProtocolError(f"model {model.name!r} did not wake within {self.wake_timeout_s:g} s "
                                        "(--wake-timeout)", status=503) from None
                except WakeFailed as e:
                    raise ProtocolError(f"model {model.name!r} is unavailable: {e}", status=503) from None
        finally:
            model.waiting -= 1
        model.in_flight += 1
        model.requests += count
        model.last_used = time.monotonic()
        return model

    def release(self, model: ServedModel) -> None:
        model.in_flight -= 1
        model.last_used = time.monotonic()

    # ---- sleeping and waking -------------------------------------------------------------------
    async def _transition(self, model: ServedModel, work) -> None:
        try:
            async with self._lock:
                await work
        finally:
            model.task = None

    async def _wake(self, model: ServedModel) -> None:
        if model.level == 0:
            return
        await self._make_room(model.weights + model.kv - model.resident_bytes(), model)
        started = time.perf_counter()
        try:
            if model.level == 1 and model.loop is not None:
                slept = model.slept
                await asyncio.wrap_future(model.loop.call(lambda e: wake_level1(e, slept)))
                model.level, model.slept = 0, None
            else:
                await asyncio.to_thread(self._load, model)
        except Exception as e:  # noqa: BLE001 - any failure to wake fails this model's requests alone
            model.error = _one_line(e)
            log.error("model %s failed to wake: %s", model.name, model.error)
            raise WakeFailed(model.error) from None
        model.last_wake_seconds = time.perf_counter() - started
        model.wakes += 1
        model.wake_seconds += model.last_wake_seconds
        if model.weights + model.kv > self.budget:  # first measured now (it had failed to load before)
            await asyncio.to_thread(self._close, model)
            model.error = (f"model {model.name!r} holds {(model.weights + model.kv) / GIB:.3f} GiB, more than "
                           f"--memory-budget-gib {self.budget_gib:g}")
            raise WakeFailed(model.error)
        if self.resident_total() > self.budget:
            await self._make_room(0, model)

    def others(self, model: ServedModel) -> list[ServedModel]:
        return [m for m in self.models.values() if m is not model]

    def resident_total(self) -> int:
        return sum(m.resident_bytes() for m in self.models.values())

    async def _make_room(self, need: int, keep: ServedModel) -> None:
        """Put the least recently used idle models to sleep until `need` more bytes fit the budget
        (deeper, to level 2, where level 1 leaves too much); waits for busy ones within the bound."""
        deadline = time.monotonic() + self.wake_timeout_s
        while self.resident_total() + need > self.budget:
            idle = [m for m in self.others(keep)
                    if m.in_flight == 0 and m.resident_bytes() > 0 and not self._claimed(m)]
            if not idle:
                if time.monotonic() > deadline:
                    raise WakeFailed(f"no room under --memory-budget-gib {self.budget_gib:g}: the other models "
                                     "are busy")
                await asyncio.sleep(0.05)
                continue
            victim = min(idle, key=lambda m: m.last_used)
            level = self.sleep_level if victim.level == 0 else 2
            await self._sleep(victim, level)

    @staticmethod
    def _claimed(model: ServedModel) -> bool:
        """Whether `model` is awake for requests about to run on it (they need no lock, so they will
        run and release it). Any other model's sleep or wake is queued behind the lock the caller
        holds (`_transition`), so waiting for it would wait forever: such a model may be put deeper
        to sleep, and its queued wake then loads it again."""
        return model.level == 0 and model.task is None and model.waiting > 0

    async def _sleep(self, model: ServedModel, level: int) -> None:
        if model.in_flight:
            raise ProtocolError(f"model {model.name!r} has {model.in_flight} request(s) in flight; it can sleep "
                                "once they finish", status=409)
        if level <= model.level:
            return
        if level == 1 and not level1_supported(model.loop.engine):
            level = 2  # tensor parallelism or captured CUDA graphs (sleep.py)
        if level == 1:
            model.slept = await asyncio.wrap_future(model.loop.call(sleep_level1))
            model.level = 1
        else:
            await asyncio.to_thread(self._close, model)
        log.info("model %s sleeps at level %d", model.name, level)

    async def sleep(self, model: ServedModel, level: int) -> None:
        """POST /sleep: `model` to `level` (1 or 2) now."""
        if level not in (1, 2):
            raise ProtocolError(f"level={level} is invalid: allowed 1 or 2", param="level")
        while model.task is not None:
            await asyncio.shield(model.task)
        model.task = asyncio.ensure_future(self._transition(model, self._sleep(model, level)))
        await asyncio.shield(model.task)

    async def wake(self, model: ServedModel) -> None:
        """POST /wake_up: `model` awake now (503 when it cannot be)."""
        await self.acquire(model, count=False)
        self.release(model)

    # ---- keep-alive ----------------------------------------------------------------------------
    def start_keep_alive(self) -> None:
        """Put models idle past `keep_alive_s` to sleep, checking a few times per keep-alive (0: never)."""
        if self.keep_alive_s > 0 and self._keeper is None:
            self._keeper = asyncio.ensure_future(self._keep_alive())

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.keep_alive_s / 4))
            now = time.monotonic()
            for model in self.models.values():
                if (model.level == 0 and model.in_flight == 0 and model.task is None
                        and now - model.last_used > self.keep_alive_s):
                    model.task = asyncio.ensure_future(self._transition(model, self._sleep(model, self.sleep_level)))
                    model.task.add_done_callback(_logged)

    # ---- what it shows -------------------------------------------------------------------------
    def listing(self) -> list[dict]:
        return [{"id": m.name, "object": "model", "owned_by": "tessera", "state": m.state, "sleep_level": m.level,
                 **({"max_model_len": m.loop.engine.max_model_len} if m.loop is not None else {}),
                 **({"error": m.error} if m.error else {})} for m in self.models.values()] + [
            {"id": f"{m.name}:{a}", "object": "model", "owned_by": "tessera", "parent": m.name, "state": m.state}
            for m in self.models.values() for a in m.adapters]

    def prometheus(self) -> str:
        rows = [("model_requests_total", "counter", "Requests routed to the model.", lambda m: m.requests),
                ("model_prompt_tokens_total", "counter", "Prompt tokens.", lambda m: m.token_counts()[0]),
                ("model_generation_tokens_total", "counter", "Generated tokens.", lambda m: m.token_counts()[1]),
                ("model_sleep_level", "gauge", "0 awake, 1 or 2 asleep.", lambda m: m.level),
                ("model_wakes_total", "counter", "Times the model was woken.", lambda m: m.wakes),
                ("model_wake_seconds_total", "counter", "Seconds spent waking it.", lambda m: m.wake_seconds),
                ("model_resident_bytes", "gauge", "Bytes counted against the budget.", lambda m: m.resident_bytes())]
        lines = []
        for name, kind, doc, value in rows:
            lines += [f"# HELP tessera_{name} {doc}", f"# TYPE tessera_{name} {kind}"]
            lines += [f'tessera_{name}{{model="{m.name}"}} {value(m)}' for m in self.models.values()]
        lines += ["# HELP tessera_memory_budget_bytes The budget (--memory-budget-gib).",
                  "# TYPE tessera_memory_budget_bytes gauge", f"tessera_memory_budget_bytes {self.budget}"]
        return "\n".join(lines) + "\n"


def _logged(task: asyncio.Task) -> None:
    """A keep-alive sleep's failure, logged (nobody awaits it)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("keep-alive sleep failed: %s", _one_line(task.exception()))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else 'no detail'}"[:500]


def _forget_endpoint_callables() -> None:
    """FastAPI (0.16x) classifies each endpoint callable once and keeps the answers in caches of 4096
    entries, the callables included: each route's bound method of a dropped model's app, and through
    it the engine and its weights, would stay alive. A model put down to level 2 clears them (FastAPI
    classifies the live apps' endpoints again on their next requests)."""
    try:
        from fastapi.dependencies import models as dependencies
    except ImportError:  # pragma: no cover - FastAPI is a dependency of serving
        return
    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cache_clear = getattr(getattr(dependencies, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
