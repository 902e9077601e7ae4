"""`POST /profile/start` and `POST /profile/stop` (`tessera serve --profile-dir DIR`, the paths vLLM
uses): the engine records its steps between them (tessera/infer/engine/step_profile.py) and appends
each session to DIR/engine.jsonl, which `tessera profile DIR` reads. Both run on the engine thread,
between steps; both answer JSON saying whether it records. With --api-key they need the key, as /v1
routes do. While it records, each HTTP request is timed in its parts too (http_profile.py, an ASGI
middleware: add the routes after the other middleware, so that it is the outermost)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tessera.infer.api.http_profile import HttpProfile
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.engine.step_profile import EngineProfile

PATHS = ("/profile/start", "/profile/stop")


def add_profile_routes(app: FastAPI, loop: EngineLoop, directory: Path | str) -> None:
    """The engine's recorder writing under `directory`, the two routes that start and stop it, and the
    middleware timing HTTP requests while it records."""
    profile = EngineProfile(directory)
    loop.engine.profile = profile
    app.add_middleware(HttpProfile, profile=profile)

    async def start() -> JSONResponse:
        return JSONResponse(await asyncio.wrap_future(loop.call(lambda _engine: profile.start())))

    async def stop() -> JSONResponse:
        return JSONResponse(await asyncio.wrap_future(loop.call(lambda _engine: profile.stop())))

    app.add_api_route(PATHS[0], start, methods=["POST"])
    app.add_api_route(PATHS[1], stop, methods=["POST"])
