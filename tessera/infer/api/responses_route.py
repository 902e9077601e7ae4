"""The Responses API's routes: `POST /v1/responses` (openai_responses.py: the request; responses_output.py:
the answer, streamed as server-sent events with `"stream": true`) and `GET /v1/responses/{response_id}`
(a stored response: response_store.py). `add_responses_routes(app, routes)` adds them to the server's
app (server.py), on its engine thread, tokenizer, agent turns (`--tool-call-parser`, ...), model
names and guards.

A request is prepared in a worker thread (its conversation rendered by the chat template, tokenised,
checked once by the engine) and refused there with a 4xx naming the field. A finished response is
stored unless `store` is false; a client that goes away first has its request aborted, and nothing
is stored. A request that fails while generating answers 500 (400 when its own schemas failed in
the grammar engine, naming `tools` where its calls were constrained, `text` otherwise), or ends
its stream with `response.failed`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera.config.errors import RequestError
from tessera.config.json_text import parse_json
from tessera.infer.agents.turn_plan import AgentTurns, TurnPlan
from tessera.infer.api.openai_protocol import ProtocolError, error_body
from tessera.infer.api.openai_responses import FIELDS, ResponsesRequest, protocol_error, responses_request
from tessera.infer.api.quoting import brief
from tessera.infer.api.response_store import ResponseStore, StoredResponse
from tessera.infer.api.responses_output import ResponseBuilder, new_id, response_object
from tessera.infer.engine.checked_request import CheckedRequest
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.engine.sequence import RequestOutput

DISCONNECT_POLL_S = 0.25  # how often a response that is not streamed checks that its client is still there


class ServerRoutes(Protocol):
    """What the routes use of the server's (server.py's `_Routes`)."""

    loop: EngineLoop
    engine: Any
    tokenizer: Any
    model_name: str
    turns: AgentTurns

    def adapter_of(self, body: dict) -> str | None: ...

    def encode(self, prompt: str, special: bool = True) -> list[int]: ...


def add_responses_routes(app: FastAPI, routes: ServerRoutes, store: ResponseStore | None = None) -> None:
    """Route POST /v1/responses and GET /v1/responses/{response_id} of `app`."""
    handlers = ResponsesRoutes(routes, store or ResponseStore())
    app.add_api_route("/v1/responses", handlers.create, methods=["POST"], name="responses")
    app.add_api_route("/v1/responses/{response_id}", handlers.retrieve, methods=["GET"], name="retrieve_response")


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class ResponsesRoutes:
    def __init__(self, routes: ServerRoutes, store: ResponseStore):
        self.routes, self.store = routes, store

    def prepare(self, raw: bytes) -> tuple[ResponsesRequest, CheckedRequest, TurnPlan, str]:
        """The request, checked by the engine, its turn's plan and the model name it answers with
        (in a worker thread)."""
        body = parse_json(raw, "request body", ProtocolError)
        if not isinstance(body, dict):
            raise ProtocolError("request body must be a JSON object")
        routes = self.routes
        if routes.tokenizer is None:
            raise ProtocolError("this model has no tokenizer, so no chat template", param="input")
        adapter = routes.adapter_of(body)
        request = responses_request(body, self.store)
        try:
            plan = routes.turns.prepare(request.turn)
            ids = routes.encode(plan.prompt, special=False)
            params = request.sampling(routes.engine.max_model_len - len(ids))
            params = plan.sampling(params)
            checked = routes.engine.check_request(ids, params, adapter)
        except ProtocolError as e:
            raise ProtocolError(str(e), e.status, FIELDS.get(e.param, e.param)) from None
        except RequestError as e:
            if e.field == "response_format":  # a text format on a turn whose calls are constrained
                raise ProtocolError(f"text.format={brief(request.echo['text'].get('format'))} is invalid: must be "
                                    "{'type': 'text'} when tool calls are constrained (tool_choice required or a "
                                    "function, or a strict tool)", param="text") from None
            raise protocol_error(e) from None
        name = body["model"] if isinstance(body.get("model"), str) else routes.model_name
        return request, checked, plan, name

    async def create(self, request: Request) -> Response:
        asked, checked, plan, name = await asyncio.to_thread(self.prepare, await request.body())
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def deliver(out: RequestOutput) -> None:
            try:
                event_loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                pass

        rid = self.routes.loop.submit_checked(checked, deliver)
        builder = ResponseBuilder(response_object(new_id("resp"), name, asked.echo), plan.decoder())
        if asked.stream:
            return StreamingResponse(self._events(queue, rid, builder, asked), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        constraint = "tools" if plan.guided_grammar is not None else "text"  # what a failing grammar came from
        return await self._whole(request, queue, rid, builder, asked, constraint)

    async def retrieve(self, response_id: str) -> Response:
        found = self.store.get(response_id)
        if found is None:
            raise ProtocolError(f"response {brief(response_id)} is not stored (never stored, stored with store: "
                                "false, or evicted)", status=404, param="response_id")
        return JSONResponse(found.response)

    def _keep(self, asked: ResponsesRequest, builder: ResponseBuilder) -> None:
        """Store a finished response, unless the request said `store: false`."""
        if asked.store and builder.response["status"] in ("completed", "incomplete"):
            self.store.put(StoredResponse(builder.response, asked.history + (builder.assistant_message(),)))

    async def _whole(self, request: Request, queue: asyncio.Queue, rid: str, builder: ResponseBuilder,
                     asked: ResponsesRequest, constraint: str) -> Response:
        """Run the output through the builder, dropping the events; abort if the client goes away."""
        finished: RequestOutput | None = None
        try:
            while finished is None:
                try:
                    out = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                builder.step(out)
                finished = out if out.finished else None
        finally:
            if finished is None:
                self.routes.loop.abort(rid)
        if finished.finish_reason == "error":
            status, param = (400, constraint) if finished.client_error else (500, None)
            return JSONResponse(error_body(f"generation failed: {finished.error}", status, param), status_code=status)
        self._keep(asked, builder)
        return JSONResponse(builder.response)

    async def _events(self, queue: asyncio.Queue, rid: str, builder: ResponseBuilder,
                      asked: ResponsesRequest) -> AsyncIterator[str]:
        done = False
        try:
            for event in builder.start():
                yield _sse(event)
            while not done:
                out = await queue.get()
                events = builder.step(out)
                done = out.finished
                if done:  # stored before the client hears it finished, so that it may continue it at once
                    self._keep(asked, builder)
                for event in events:
                    yield _sse(event)
        finally:
            if not done:
                self.routes.loop.abort(rid)
