"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine thread.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream with server-sent events when
`"stream": true`), GET /v1/models, GET /health, GET /metrics (Prometheus text), and, when enabled,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter. A request's `model` is the served model
name (base weights) or the name of a loaded LoRA adapter.

With an API key, every /v1 route needs `Authorization: Bearer <key>`; /health and /metrics stay
open for probes and scrapers. Bad JSON, unknown fields values, an unknown model or a prompt too
long for the context get a 4xx with an OpenAI-style error body; the engine keeps serving. A client
that disconnects has its request aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tessera.config.errors import TesseraError
from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE
from tessera.infer.engine_loop import EngineLoop
from tessera.infer.openai_protocol import (
    ProtocolError,
    choice,
    chunk_object,
    completion_object,
    error_body,
    messages_of,
    new_id,
    prompts_of,
    sampling_params,
    usage,
)
from tessera.infer.sequence import RequestOutput


class APIKeyCheck:
    """ASGI middleware: /v1 routes need `Authorization: Bearer <key>`. (A plain ASGI wrapper, not
    Starlette's BaseHTTPMiddleware, which would hide client disconnects from the handlers.)"""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error("missing or wrong API key (send 'Authorization: Bearer <key>')", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    return body


def create_app(loop: EngineLoop, model_name: str, api_key: str | None = None,
               allow_lora_loading: bool = False, aliases: tuple[str, ...] = ()) -> FastAPI:
    """The app. Requests may name the base model by `model_name` or any of `aliases` (e.g. the
    model directory as given on the command line, its absolute path and its base name)."""
    engine = loop.engine
    base_names = {model_name, *aliases}
    tokenizer = engine.tokenizer
    app = FastAPI(title="Tessera", docs_url=None, redoc_url=None)

    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)

    @app.exception_handler(ProtocolError)
    async def protocol_error(_request: Request, e: ProtocolError) -> JSONResponse:
        return _error(str(e), e.status, e.param)

    @app.exception_handler(TesseraError)
    async def tessera_error(_request: Request, e: TesseraError) -> JSONResponse:
        return _error(str(e), 400)

    @app.get("/health")
    async def health() -> Response:
        if not loop.alive:
            return _error("engine thread is not running", 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": model_name, "object": "model", "owned_by": "tessera", "max_model_len": engine.max_model_len}]
        data += [{"id": name, "object": "model", "owned_by": "tessera", "parent": model_name}
                 for name in list(engine.lora.adapters)]
        return JSONResponse({"object": "list", "data": data})

    def adapter_of(body: dict) -> str | None:
        name = body.get("model")
        if name is None or name in base_names:
            return None
        if isinstance(name, str) and name in engine.lora.adapters:
            return name
        known = [model_name, *engine.lora.adapters]
        raise ProtocolError(f"model {name!r} does not exist; served: {known}", status=404, param="model")

    def encode(prompt: str | list[int], special: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return tokenizer.encode(prompt, add_special_tokens=special)

    async def run(request: Request, chat: bool) -> Response:
        body = await _json_body(request)
        adapter = adapter_of(body)
        if chat:
            if tokenizer is None:
                raise ProtocolError("this model has no tokenizer, so no chat template", param="messages")
            template = None if tokenizer.has_chat_template else PLAIN_CHAT_TEMPLATE
            text = tokenizer.apply_chat_template(messages_of(body), add_generation_prompt=True, chat_template=template)
            prompt_ids = [encode(text, special=False)]
        else:
            prompt_ids = [encode(p) for p in prompts_of(body)]
        room = engine.max_model_len - max(len(p) for p in prompt_ids)
        params = sampling_params(body, default_max_tokens=max(1, room) if chat else 16)
        for ids in prompt_ids:
            engine.validate_request(len(ids), params, adapter)
            if any(not 0 <= t < engine.cfg.vocab_size for t in ids):
                raise ProtocolError(f"prompt token ids must be in 0..{engine.cfg.vocab_size - 1}", param="prompt")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ProtocolError("'stream' must be a boolean", param="stream")
        options = body.get("stream_options") or {}
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))

        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def callback_for(index: int):
            def deliver(out: RequestOutput) -> None:
                try:
                    event_loop.call_soon_threadsafe(queue.put_nowait, (index, out))
                except RuntimeError:  # the event loop is closed: the server is shutting down
                    pass
            return deliver

        rids = [loop.submit(ids, params, adapter, callback_for(i)) for i, ids in enumerate(prompt_ids)]
        rid = new_id("chatcmpl" if chat else "cmpl")
        name = body.get("model") if isinstance(body.get("model"), str) else model_name
        if stream:
            return StreamingResponse(_stream(loop, queue, rids, rid, name, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, loop, queue, rids, rid, name, chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    async def lora_call(request: Request, load: bool) -> Response:
        if not allow_lora_loading:
            return _error("loading adapters at run time is disabled (start the server with --allow-runtime-lora)", 403)
        body = await _json_body(request)
        name = body.get("lora_name")
        path = body.get("lora_path")
        if not isinstance(name, str) or (load and not isinstance(path, str)):
            raise ProtocolError("'lora_name' (and 'lora_path' to load) must be strings")
        fn = (lambda e: e.load_lora(name, path)) if load else (lambda e: e.unload_lora(name))
        await asyncio.wrap_future(loop.call(fn))
        return JSONResponse({"status": "ok", "lora_name": name})

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        return await lora_call(request, load=True)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        return await lora_call(request, load=False)

    return app


async def _collect(request: Request, loop: EngineLoop, queue: asyncio.Queue, rids: list[str], rid: str, name: str,
                   chat: bool) -> Response:
    """Wait for every choice; abort them all if the client goes away first."""
    done: dict[int, RequestOutput] = {}
    try:
        while len(done) < len(rids):
            try:
                index, out = await asyncio.wait_for(queue.get(), timeout=0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if out.finished:
                done[index] = out
    finally:
        for i, r in enumerate(rids):
            if i not in done:
                loop.abort(r)
    errors = [o.error for o in done.values() if o.finish_reason == "error"]
    if errors:
        return _error(f"generation failed: {errors[0]}", 500)
    outs = [done[i] for i in range(len(rids))]
    choices = [choice(i, o.text, o.finish_reason, chat, stream=False) for i, o in enumerate(outs)]
    use = usage(sum(o.prompt_tokens for o in outs), sum(len(o.token_ids) for o in outs))
    return JSONResponse(completion_object(rid, name, choices, use, chat))


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def _stream(loop: EngineLoop, queue: asyncio.Queue, rids: list[str], rid: str, name: str, chat: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step with new text, the finish reason last, then [DONE]."""
    finished: set[int] = set()
    prompt_tokens = completion_tokens = 0
    try:
        if chat:
            for i in range(len(rids)):
                yield _sse(chunk_object(rid, name, [choice(i, "", None, chat, True, first=True)], chat))
        while len(finished) < len(rids):
            index, out = await queue.get()
            if out.finish_reason == "error":
                finished.add(index)
                yield _sse(error_body(f"generation failed: {out.error}", 500))
                continue
            if out.delta or out.finished:
                c = choice(index, out.delta, out.finish_reason, chat, True)
                yield _sse(chunk_object(rid, name, [c], chat))
            if out.finished:
                finished.add(index)
                prompt_tokens += out.prompt_tokens
                completion_tokens += len(out.token_ids)
        if include_usage:
            yield _sse(chunk_object(rid, name, [], chat, usage(prompt_tokens, completion_tokens)))
        yield _sse("[DONE]")
    finally:
        for i, r in enumerate(rids):
            if i not in finished:
                loop.abort(r)
