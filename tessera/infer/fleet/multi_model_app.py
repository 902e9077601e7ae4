"""The HTTP front of `tessera serve --model NAME=PATH [--model ...]`: each generation request goes to
the app of the model its `model` field names (tessera/infer/api/server.py's, one per model), woken
first if it sleeps (model_registry.py).

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages, by their body's
`model` (optional when one model is served; a name not served is a 404 naming the served ones);
GET /v1/responses/{id}, asked of each awake model; GET /v1/models (each model with its `state` and
`sleep_level`); GET /health; GET /metrics (per model: requests, tokens, sleep level, wakes and the
seconds they took, bytes counted against the budget); and vLLM's sleep routes, with the model as
the `model` query parameter when several are served: POST /sleep?level=1|2, POST /wake_up,
GET /is_sleeping. The guards are the single-model server's (Host allow-list, body limit, API key,
which the sleep routes need too).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tessera.config.json_text import parse_json
from tessera.infer.api.http_guards import DEFAULT_MAX_REQUEST_BYTES, APIKeyCheck, BodyLimit, HostCheck, error_body
from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.fleet.model_registry import ModelRegistry, ServedModel

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})
SLEEP_PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping"})


def create_multi_model_app(registry: ModelRegistry, api_key: str | None = None,
                           allowed_hosts: frozenset[str] | None = None,
                           max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
    """The ASGI app in front of `registry`'s models (module docstring); starts its keep-alive."""
    app = _Dispatch(registry, _control_app(registry))
    app = BodyLimit(app, max_bytes=max_request_bytes)
    if api_key is not None:
        app = APIKeyCheck(app, api_key, also=SLEEP_PATHS)
    if allowed_hosts is not None:
        app = HostCheck(app, allowed=allowed_hosts)
    return app


async def _send_error(send, path: str, message: str, status: int, param: str | None = None) -> None:
    body = error_body(path, message, status)
    if param is not None:
        body["error"]["param"] = param
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})


def _model_field(raw: bytes) -> object:
    """The `model` of a request body (None when it has none or is not a JSON object: the model's app
    says what is wrong with it)."""
    try:
        body = parse_json(raw, "request body", ProtocolError)
    except ProtocolError:
        return None
    return body.get("model") if isinstance(body, dict) else None


class _Dispatch:
    """Generation requests to their model's app, the rest to the control routes."""

    def __init__(self, registry: ModelRegistry, control: FastAPI):
        self.registry, self.control = registry, control

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http":
            await self.control(scope, receive, send)
        elif scope["method"] == "POST" and path in GENERATION_PATHS:
            await self.generate(scope, receive, send, path)
        elif scope["method"] == "GET" and path.startswith("/v1/responses/"):
            await self.stored_response(scope, receive, send)
        else:
            await self.control(scope, receive, send)

    async def generate(self, scope, receive, send, path: str) -> None:
        message = await receive()  # BodyLimit hands the body over in one piece
        raw = message.get("body", b"")
        name = await asyncio.to_thread(_model_field, raw)
        try:
            if name is None and len(self.registry.models) == 1:
                name = next(iter(self.registry.models))
            model = await self.registry.acquire(self.registry.lookup(name))
        except ProtocolError as e:
            await _send_error(send, path, str(e), e.status, e.param)
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return message
            return await receive()

        try:
            await model.app(scope, replay, send)
        finally:
            self.registry.release(model)

    async def stored_response(self, scope, receive, send) -> None:
        """GET /v1/responses/{id}: the first awake model that stores it answers."""
        for model in [m for m in self.registry.models.values() if m.level == 0 and m.app is not None]:
            sent: list[dict] = []

            async def keep(message, sent=sent) -> None:
                sent.append(message)

            await model.app(scope, receive, keep)
            if sent and sent[0].get("status") != 404:
                for message in sent:
                    await send(message)
                return
        await _send_error(send, scope["path"], "no stored response with that id (or its model sleeps at level 2)",
                          404)


def _control_app(registry: ModelRegistry) -> FastAPI:
    app = FastAPI(title="Tessera", docs_url=None, redoc_url=None)
    app.router.add_event_handler("startup", registry.start_keep_alive)

    @app.exception_handler(ProtocolError)
    async def refused(request: Request, e: ProtocolError) -> JSONResponse:
        body = error_body(request.url.path, str(e), e.status)
        body["error"]["param"] = e.param
        return JSONResponse(body, status_code=e.status)

    def named(model: str | None) -> ServedModel:
        if model is None and len(registry.models) == 1:
            return next(iter(registry.models.values()))
        if model is None:
            raise ProtocolError(f"several models are served: name one with ?model= (one of {list(registry.models)})",
                                param="model")
        return registry.lookup(model)

    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(registry.prometheus(), media_type="text/plain; version=0.0.4")

    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": registry.listing()})

    async def sleep(level: int = 1, model: str | None = None) -> JSONResponse:
        served = named(model)
        await registry.sleep(served, level)
        return JSONResponse({"model": served.name, "is_sleeping": served.level > 0, "level": served.level})

    async def wake_up(model: str | None = None) -> JSONResponse:
        served = named(model)
        await registry.wake(served)
        return JSONResponse({"model": served.name, "is_sleeping": False, "level": 0})

    async def is_sleeping(model: str | None = None) -> JSONResponse:
        served = named(model)
        return JSONResponse({"model": served.name, "is_sleeping": served.level > 0, "level": served.level})

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/sleep", sleep, methods=["POST"])
    app.add_api_route("/wake_up", wake_up, methods=["POST"])
    app.add_api_route("/is_sleeping", is_sleeping, methods=["GET"])
    return app
