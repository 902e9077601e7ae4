"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine thread.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream with server-sent events when
`"stream": true`; their sampling fields in `openai_protocol`, the choices of a request, `n` per
prompt, with their log-probabilities in `openai_choices`, collected or streamed by `openai_answers`;
a chat's tools, tool calls and reasoning in `openai_tools`, over the agent turn of
tessera/infer/agents/turn_plan.py), POST /v1/responses and GET /v1/responses/{id} (the Responses
API, over the same agent turn: `responses_route`), POST /v1/messages (Anthropic's Messages API, over
the same turn and in its own shapes: `anthropic_route`), GET /v1/models, GET /health, GET /metrics
(Prometheus text), and, when enabled, POST /v1/load_lora_adapter and /v1/unload_lora_adapter. A
request's `model` is one of the names /v1/models lists: the served model name (base weights) or the
name of a loaded LoRA adapter. vLLM's sleep routes, POST /sleep?level=1, POST /wake_up and
GET /is_sleeping (`sleep_routes`: level 1 frees the KV cache; a request arriving asleep wakes it).

In front of the routes (`http_guards`): an allow-list of `Host` names, a request-body size limit
(413) and, with an API key, `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's
clients send it) on every /v1 route, the sleep routes and /metrics (/health stays open for probes). With `kv_role`
(prefill/decode disaggregation, `kv_transfer.py`):
POST /v1/kv/prefill on a prefill instance, POST /v1/kv/import on a decode instance, behind the same
guards and, apart from the API key, the KV peer secret (kv_peer.py: a prefill request signed with
it, a transfer message made with it; 403 otherwise). Bad JSON (also nesting too deep to parse), wrong-typed or
out-of-range fields, an unknown model or a prompt too long for the context get a 4xx with an
OpenAI-style error body (Anthropic's on /v1/messages) that never quotes more than a short piece of
the request; the engine keeps serving. Parsing, chat templates and tokenisation run in worker threads
so that a large request never stalls the event loop; a chat's images are fetched on the event loop
between them (`media`), so that a slow image host holds no thread another request needs. Runtime
adapter loading reads only from the configured adapter directories. A client that disconnects has
its request aborted, which frees its KV blocks.
/health answers 503 when the engine cannot serve any more (its thread has ended, or a
tensor-parallel rank failed or exited); `tessera serve` then shuts down with exit status 1.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tessera.config.errors import ConfigError, ImageError, RequestError, TesseraError
from tessera.config.json_text import parse_json
from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE
from tessera.infer.agents.options import AgentOptions
from tessera.infer.agents.turn_plan import AgentTurns, TurnPlan
from tessera.infer.api.anthropic_route import serve_messages
from tessera.infer.api.http_guards import DEFAULT_MAX_REQUEST_BYTES, add_guards, check_api_key
from tessera.infer.api.media import MediaPolicy, chat_images
from tessera.infer.api.openai_answers import collect
from tessera.infer.api.openai_answers import stream as stream_answer
from tessera.infer.api.openai_choices import Choices, child_params
from tessera.infer.api.openai_logprobs import TokenTexts
from tessera.infer.api.openai_protocol import (
    ProtocolError,
    choices_per_prompt,
    error_body,
    new_id,
    prompts_of,
    sampling_params,
)
from tessera.infer.api.openai_tools import chat_turn
from tessera.infer.api.profile_routes import add_profile_routes
from tessera.infer.api.quoting import brief
from tessera.infer.api.responses_route import add_responses_routes
from tessera.infer.api.sleep_routes import PATHS as SLEEP_PATHS
from tessera.infer.api.sleep_routes import add_sleep_routes
from tessera.infer.engine.checked_request import CheckedRequest
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.engine.sequence import RequestOutput
from tessera.infer.runner.lora import confined_adapter_dir, read_adapter
from tessera.infer.sampling.params import SamplingParams
from tessera.infer.scheduling.kv_peer import (
    PEER_SIGNATURE_HEADER,
    UnauthenticatedPeer,
    check_prefill_request,
    require_peer_secret,
)
from tessera.infer.scheduling.kv_transfer import (
    TransferError,
    export_prefix,
    import_prefix,
    open_transfer,
    transfer_limit,
)


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def _parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; ProtocolError (400) for anything else."""
    body = parse_json(raw, "request body", ProtocolError)
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    return body


def _longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (an upper bound: the length of its
    longest vocabulary string), so that a text longer than max_model_len times this cannot fit."""
    try:
        return max(1, max(len(t) for t in tokenizer.backend.get_vocab(with_added_tokens=True)))
    except (AttributeError, TypeError, ValueError):  # no tokenizer, or one without a vocabulary to read
        return 1 << 30


async def _json_body(request: Request) -> dict[str, Any]:
    return await asyncio.to_thread(_parse_json, await request.body())


def create_app(loop: EngineLoop, model_name: str, api_key: str | None = None,
               allow_lora_loading: bool = False,
               lora_dirs: Sequence[str | Path] = (), max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               allowed_hosts: frozenset[str] | None = None, kv_role: str | None = None,
               media: MediaPolicy | None = None, kv_peer_secret: bytes | None = None,
               agents: AgentOptions | None = None, profile_dir: str | Path | None = None) -> FastAPI:
    """The app. Requests name the base model by `model_name` exactly, the name /v1/models lists
    (any other name gets a 404 naming the served ones). Runtime adapter loading
    (`allow_lora_loading`) reads only from inside `lora_dirs`; `allowed_hosts` None answers any
    Host header; `media` says where chat images may come from (None: data: URLs only); `kv_role`
    needs `kv_peer_secret`, which authenticates KV transfers (kv_transfer.py); `agents`: how tool
    calls and reasoning are read (None: `AgentOptions()`, neither); `profile_dir`: POST /profile/start and
    /profile/stop record engine steps there (profile_routes.py; None: no such routes)."""
    check_api_key(api_key)
    if kv_role is not None:
        require_peer_secret(kv_peer_secret, f"kv_role={kv_role!r}")
    if allow_lora_loading and not lora_dirs:
        raise ConfigError("runtime LoRA loading needs at least one adapter directory (--lora-modules-dir DIR)")
    if max_request_bytes < 1:
        raise ConfigError(f"max_request_bytes={max_request_bytes} is invalid: must be >= 1")
    routes = _Routes(loop, model_name, allow_lora_loading, [Path(d) for d in lora_dirs], media or MediaPolicy(),
                     kv_peer_secret or b"", agents or AgentOptions())
    app = FastAPI(title="Tessera", docs_url=None, redoc_url=None)

    # a decode instance takes up to one sequence's KV blocks on /v1/kv/import
    kv_limit = {"/v1/kv/import": transfer_limit(loop.engine)} if kv_role == "decode" else {}
    add_sleep_routes(app, loop, model_name)  # POST /sleep, /wake_up, GET /is_sleeping; innermost: wakes /v1 POSTs
    add_guards(app, api_key, allowed_hosts, max_request_bytes, kv_limit, key_also=SLEEP_PATHS)

    _answer_errors(app)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])

    def post(path: str, name: str, handler: Callable[..., Awaitable[Response]], **flag: bool) -> None:
        """Route POST `path` (operation `name`) to `handler(request, **flag)`."""
        async def endpoint(request: Request) -> Response:
            return await handler(request, **flag)
        app.add_api_route(path, endpoint, methods=["POST"], name=name)

    post("/v1/completions", "completions", routes.run, chat=False)
    post("/v1/chat/completions", "chat_completions", routes.run, chat=True)
    add_responses_routes(app, routes)  # POST /v1/responses, GET /v1/responses/{id} (responses_route.py)
    post("/v1/messages", "messages", lambda request: serve_messages(routes, request))
    if kv_role == "prefill":
        post("/v1/kv/prefill", "kv_prefill", routes.kv_prefill)
    elif kv_role == "decode":
        post("/v1/kv/import", "kv_import", routes.kv_import)
    if profile_dir is not None:
        add_profile_routes(app, loop, profile_dir)
    post("/v1/load_lora_adapter", "load_lora", routes.lora_call, load=True)
    post("/v1/unload_lora_adapter", "unload_lora", routes.lora_call, load=False)
    return app


def _answer_errors(app: FastAPI) -> None:
    """A refused request's answer: its status (400 unless the error says) naming its field."""
    @app.exception_handler(ProtocolError)
    async def protocol_error(_request: Request, e: ProtocolError) -> JSONResponse:
        return _error(str(e), e.status, e.param)

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, e: RequestError) -> JSONResponse:
        return _error(str(e), 400, e.field)  # a field the request spells (the agent turn's refusals)

    @app.exception_handler(TesseraError)
    async def tessera_error(_request: Request, e: TesseraError) -> JSONResponse:
        return _error(str(e), 400)


class _Routes:
    """The handlers of the routes, around the engine thread `loop`."""

    def __init__(self, loop: EngineLoop, model_name: str, allow_lora_loading: bool, roots: list[Path],
                 media: MediaPolicy, kv_key: bytes, agents: AgentOptions):
        self.loop, self.engine, self.model_name, self.media = loop, loop.engine, model_name, media
        self.kv_key = kv_key  # the KV peer secret (b"": no KV role)
        self.tokenizer = loop.engine.tokenizer
        self.allow_lora_loading, self.roots = allow_lora_loading, roots
        self.max_prompt_chars = self.engine.max_model_len * _longest_token_chars(self.tokenizer)
        template = None if self.tokenizer is None or self.tokenizer.has_chat_template else PLAIN_CHAT_TEMPLATE
        self.turns = AgentTurns(agents, self.tokenizer, template)  # tools, calls and reasoning of chat turns

    async def health(self) -> Response:
        if not self.loop.alive:
            return _error("engine thread is not running", 503)
        failure = self.engine.failure
        if failure is not None:  # every request would fail: tell the supervisor to restart the server
            return _error(f"engine failed: {str(failure).splitlines()[0]}", 503)
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(self.engine.prometheus(), media_type="text/plain; version=0.0.4")

    async def models(self) -> JSONResponse:
        name, engine = self.model_name, self.engine
        data = [{"id": name, "object": "model", "owned_by": "tessera", "max_model_len": engine.max_model_len}]
        data += [{"id": adapter, "object": "model", "owned_by": "tessera", "parent": name}
                 for adapter in list(engine.lora.adapters)]
        return JSONResponse({"object": "list", "data": data})

    def adapter_of(self, body: dict) -> str | None:
        name = body.get("model")
        if name is None:
            return None
        if not isinstance(name, str):
            raise ProtocolError(f"'model' must be a string, got {type(name).__name__}", param="model")
        if name == self.model_name:
            return None
        if name in self.engine.lora.adapters:
            return name
        adapter = name.removeprefix(self.model_name + ":")  # MODEL:ADAPTER, as the several-models server names it
        if adapter != name and adapter in self.engine.lora.adapters:
            return adapter
        known = [self.model_name, *self.engine.lora.adapters]
        raise ProtocolError(f"model {brief(name)} does not exist; served: {known}", status=404, param="model")

    def encode(self, prompt: str | list[int], special: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        if len(prompt) > self.max_prompt_chars:  # refused before spending seconds tokenising megabytes
            raise ProtocolError(f"this model's maximum context length is {self.engine.max_model_len} tokens; a "
                                f"prompt of {len(prompt)} characters cannot fit (at most {self.max_prompt_chars})",
                                param="prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=special)

    async def prepared(self, raw: bytes | dict, chat: bool) -> tuple[dict, list[list[int]], SamplingParams,
                                                                      list[str] | None, list[CheckedRequest],
                                                                      TurnPlan | None]:
        """`prepare`'s result for a request body (its bytes, or the document a KV prefill request
        holds, parsed already: written back as JSON it could be too deep to parse again): parsed (and
        a chat's images counted) in a worker thread, the images fetched on the event loop
        (`MediaPolicy.fetch_all`: a slow image host holds no thread that other requests need), the
        rest in a worker thread again."""
        body, chat_parts = await asyncio.to_thread(self.parse, raw, chat)
        blobs = await self.media.fetch_all(chat_parts[1]) if chat_parts else []
        return await asyncio.to_thread(self.prepare, body, chat_parts, blobs)

    def parse(self, raw: bytes | dict, chat: bool) -> tuple[dict, tuple[list[dict[str, str]], list[str], str] | None]:
        """The body and, for a chat, its messages as text (each image a marker), the images' urls
        (their number checked) and the marker."""
        body = raw if isinstance(raw, dict) else _parse_json(raw)
        self.adapter_of(body)
        if not chat:
            return body, None
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer, so no chat template", param="messages")
        marker = f"<tessera-image-{uuid.uuid4().hex}>"  # a client cannot forge an image's place
        messages, urls = chat_images(body, marker)
        self.check_images(urls)
        return body, (messages, urls, marker)

    def prepare(self, body: dict, chat_parts: tuple[list[dict[str, str]], list[str], str] | None,
                blobs: list[bytes]) -> tuple[dict, list[list[int]], SamplingParams, list[str] | None,
                                             list[CheckedRequest], TurnPlan | None]:
        """Body, prompt token ids, sampling parameters, the prompts' texts to echo (None: no echo),
        the checked requests (`n` per prompt, in order) and a chat's agent turn (None for completions)
        of a request (in a worker thread: chat templates, decoding images, tokenisation and compiling
        a schema may take a while); a chat comes with `parse`'s parts and its images' bytes. The
        engine checks each request once, here (`LLMEngine.check_request`); a refusal is a 400 naming
        the field."""
        adapter, chat = self.adapter_of(body), chat_parts is not None
        pixels: list = []
        turn = None
        if chat:
            messages, urls, marker = chat_parts
            turn = self.turns.prepare(chat_turn(body, messages))  # tools, tool choice, template kwargs
            text = turn.prompt
            pixels = self.pixels(urls, blobs)
            prompt_ids, echoes = [self.encode_around(text, marker)], None
        else:
            prompts = prompts_of(body)
            prompt_ids = [self.encode(p) for p in prompts]
            echoes = self.echoes(body, prompts, prompt_ids)
        engine = self.engine
        try:
            room = engine.max_model_len - max(len(engine.with_images(ids, pixels)[0]) for ids in prompt_ids)
            params = sampling_params(body, default_max_tokens=max(1, room) if chat else 16, chat=chat)
            params = turn.sampling(params) if turn is not None else params  # the tool-call grammar
            n = choices_per_prompt(body)
            requests = [engine.check_request(ids, child_params(params, j), adapter, pixels)
                        for ids in prompt_ids for j in range(n)]
        except ProtocolError:
            raise
        except RequestError as e:
            raise ProtocolError.of(e, chat) from None
        except ConfigError as e:  # the images do not fit their marks (`with_images`)
            raise ProtocolError(str(e), param="messages" if chat else "prompt") from None
        return body, prompt_ids, params, echoes, requests, turn

    def check_images(self, urls: list[str]) -> None:
        """A chat's images are counted against the limit before any is fetched."""
        if not urls:
            return
        if self.engine.vision is None:
            raise ProtocolError("this model takes no images (it is not a vision-language model); send text parts "
                                "only", param="messages")
        try:
            self.engine.config.check_media_count("image", len(urls))
        except RequestError as e:
            raise ProtocolError.of(e, chat=True) from None

    def pixels(self, urls: list[str], blobs: list[bytes]) -> list:
        """Pixel values of a chat's images (their encoded bytes decoded as untrusted input)."""
        out = []
        for k, (url, blob) in enumerate(zip(urls, blobs)):
            try:
                out.append(self.engine.pixel_values(blob))
            except ImageError as e:
                raise ProtocolError(f"image {k + 1} ({brief(url)}): {e}", param="messages") from None
        return out

    def encode_around(self, text: str, marker: str) -> list[int]:
        """Token ids of a chat text, with the model's image part where each `marker` stands (its image
        token; Qwen2-VL's between its vision start and end tokens: `image_part_ids`)."""
        pieces = text.split(marker)
        if len(pieces) == 1:
            return self.encode(text, special=False)
        image = self.engine.vision.image_part_ids()
        ids = self.encode(pieces[0], special=False)
        for piece in pieces[1:]:
            ids = ids + image + (self.encode(piece, special=False) if piece else [])
        return ids

    def echoes(self, body: dict, prompts: list[str | list[int]], prompt_ids: list[list[int]]) -> list[str] | None:
        """The text each prompt echoes (`echo`: the string sent, or its token ids decoded), or None."""
        if body.get("echo") is None or body.get("echo") is False:
            return None
        if body.get("echo") is not True:
            raise ProtocolError("'echo' must be a boolean", param="echo")
        if self.tokenizer is None:
            return ["" if isinstance(p, list) else p for p in prompts]
        return [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(prompts, prompt_ids)]

    async def run(self, request: Request, chat: bool) -> Response:
        body, prompt_ids, params, echoes, requests, turn = await self.prepared(await request.body(), chat)
        n = choices_per_prompt(body)
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

        loop = self.loop
        rids = [loop.submit_checked(r, callback_for(k)) for k, r in enumerate(requests)]  # k = prompt x n + choice
        rid = new_id("chatcmpl" if chat else "cmpl")
        name = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        choices = Choices(chat, params, n, prompt_ids, echoes, TokenTexts(self.tokenizer), turn)
        if stream:
            return StreamingResponse(stream_answer(loop, queue, rids, rid, name, choices, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(request, loop, queue, rids, rid, name, choices)

    async def kv_prefill(self, request: Request) -> Response:
        """Prefill instance: compute the prompt of `{"endpoint": "completions"|"chat", "request": {...}}`
        (one token, greedy) and answer its full prefix blocks as a KV transfer message; only to a request
        signed with the KV peer secret (the router's)."""
        raw = await request.body()
        try:
            check_prefill_request(self.kv_key, raw, request.headers.get(PEER_SIGNATURE_HEADER))
        except UnauthenticatedPeer as e:
            return _error(str(e), 403)
        body = await asyncio.to_thread(_parse_json, raw)
        endpoint, inner = body.get("endpoint"), body.get("request")
        if endpoint not in ("completions", "chat") or not isinstance(inner, dict):
            raise ProtocolError("KV prefill takes {'endpoint': 'completions' or 'chat', 'request': {...}}")
        _, prompt_ids, _, _, requests, _ = await self.prepared(inner, endpoint == "chat")
        if requests[0].adapter is not None or len(prompt_ids) != 1:
            raise ProtocolError("KV prefill carries the blocks of one prompt of the base model")
        ids, event_loop = prompt_ids[0], asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = event_loop.create_future()

        def deliver(out: RequestOutput) -> None:
            if out.finished:
                event_loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        rid = self.loop.submit(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), None, deliver)
        try:
            out = await done
        except asyncio.CancelledError:
            self.loop.abort(rid)
            raise
        if out.error is not None:
            return _error(f"prefill failed: {out.error}", 500)
        data = await asyncio.wrap_future(self.loop.call(lambda e: export_prefix(e, ids, self.kv_key)))
        return Response(content=data, media_type="application/octet-stream")

    async def kv_import(self, request: Request) -> Response:
        """Decode instance: take a KV transfer message made with the KV peer secret into the host tier
        (403 for any other, before anything in it is read)."""
        data = await request.body()
        try:
            transfer = await asyncio.to_thread(open_transfer, data, self.kv_key)
            kept = await asyncio.wrap_future(self.loop.call(lambda e: import_prefix(e, transfer)))
        except UnauthenticatedPeer as e:
            return _error(str(e), 403)
        except TransferError as e:
            return _error(str(e), 400)
        return JSONResponse({"blocks": kept})

    async def lora_call(self, request: Request, load: bool) -> Response:
        if not self.allow_lora_loading:
            return _error("loading adapters at run time is disabled (start the server with --allow-runtime-lora)", 403)
        body = await _json_body(request)
        name = body.get("lora_name")
        path = body.get("lora_path")
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise ProtocolError("'lora_name' must be a string of 1 to 256 characters", param="lora_name")
        if load and (not isinstance(path, str) or not path or "\0" in path):
            raise ProtocolError("'lora_path' must be a non-empty string", param="lora_path")
        if load:
            where, root = confined_adapter_dir(path, self.roots)
            weights = await asyncio.to_thread(read_adapter, where, self.engine.model, root)  # file work off the loop
            await asyncio.wrap_future(self.loop.call(lambda e: e.load_lora(name, where, weights)))
        else:
            await asyncio.wrap_future(self.loop.call(lambda e: e.unload_lora(name)))
        return JSONResponse({"status": "ok", "lora_name": name})
