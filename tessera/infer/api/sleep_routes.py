"""vLLM's sleep routes on the one-model server (`tessera serve DIR`): POST /sleep?level=1, POST
/wake_up and GET /is_sleeping; each answers `{"model", "is_sleeping", "level"}`. With --api-key
they need the key, as /v1 routes do.

Level 1 is tessera/infer/engine/sleep.py's: the KV cache freed (and, off the CPU, the weights moved
to host memory), run on the engine thread between steps. Level 2 (weights dropped, read again from
their files) needs the files and a loader, which only the several-models server keeps
(infer/fleet/model_registry.py): here it is a 400 naming level 1. An engine that cannot sleep at level 1
(tensor parallelism, or captured CUDA graphs off the CPU) gets a 400 saying why; one with requests
in flight a 409 (sleep once they finish).

A request arriving while the model sleeps wakes it and is then served, as on the several-models
server (vLLM leaves it to the client to call /wake_up first; a request that finds the model asleep
here is not refused). `SleepGate` wraps the app: every POST under /v1 waits for the wake and is
counted in flight while it runs, so that a sleep never starts under a running request.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tessera.config.errors import ConfigError
from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.engine.sleep import SleptEngine, check_can_sleep, level1_supported, sleep_level1, wake_level1

PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping"})


class EngineSleep:
    """Whether the engine behind `loop` sleeps, and the requests running on it."""

    def __init__(self, loop: EngineLoop, model_name: str):
        self.loop, self.model_name = loop, model_name
        self.slept: SleptEngine | None = None
        self.in_flight = 0
        self.wakes = 0
        self._lock = asyncio.Lock()

    def state(self) -> dict:
        level = 0 if self.slept is None else 1
        return {"model": self.model_name, "is_sleeping": level > 0, "level": level}

    async def sleep(self, level: int) -> None:
        if level != 1:
            raise ProtocolError(f"level={level} is not served by a one-model server: allowed 1 (KV cache freed); "
                                "level 2 needs `tessera serve --model NAME=PATH`", param="level")
        if not level1_supported(self.loop.engine):
            raise ProtocolError("this engine cannot sleep: sleep needs tensor_parallel_size=1 and, off the CPU, "
                                "--enforce-eager (decode graphs hold the cache's addresses)", param="level")
        async with self._lock:
            if self.slept is not None:
                return
            if self.in_flight:
                raise ProtocolError(f"{self.in_flight} request(s) in flight; the model can sleep once they finish",
                                    status=409)
            try:
                self.slept = await asyncio.wrap_future(self.loop.call(_sleep))
            except ConfigError as e:  # requests still queued in the engine (an abort not yet processed)
                raise ProtocolError(str(e), status=409) from None

    async def enter(self) -> None:
        """Wake the engine if it sleeps, and count one request in flight (`leave` when it is done)."""
        async with self._lock:
            if self.slept is not None:
                slept = self.slept
                await asyncio.wrap_future(self.loop.call(lambda e: wake_level1(e, slept)))
                self.slept = None
                self.wakes += 1
            self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1


def _sleep(engine) -> SleptEngine:
    check_can_sleep(engine)
    return sleep_level1(engine)


class SleepGate:
    """ASGI wrapper: each POST under /v1 runs with the engine awake (woken first if it sleeps)."""

    def __init__(self, app, sleep: EngineSleep):
        self.app, self.sleep = app, sleep

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        await self.sleep.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.sleep.leave()


def add_sleep_routes(app: FastAPI, loop: EngineLoop, model_name: str) -> None:
    """The three routes and the gate in front of the generation routes (add it before the guards:
    the last middleware added runs first)."""
    sleep = EngineSleep(loop, model_name)

    async def sleep_route(level: int = 1) -> JSONResponse:
        await sleep.sleep(level)
        return JSONResponse(sleep.state())

    async def wake_up() -> JSONResponse:
        await sleep.enter()
        sleep.leave()
        return JSONResponse(sleep.state())

    async def is_sleeping() -> JSONResponse:
        return JSONResponse(sleep.state())

    app.add_middleware(SleepGate, sleep=sleep)
    app.add_api_route("/sleep", sleep_route, methods=["POST"])
    app.add_api_route("/wake_up", wake_up, methods=["POST"])
    app.add_api_route("/is_sleeping", is_sleeping, methods=["GET"])
