"""`POST /v1/messages`, Anthropic's Messages API, over the server's machinery: the request read
(anthropic_messages.py) into an agent turn, planned (tessera/infer/agents/turn_plan.py: the chat
template's prompt, the constraint on the calls), checked by the engine once and run as any request;
its output read back as a message or its stream of events (anthropic_output.py). Refusals and
failures answer in Anthropic's error shape, as the guards in front do for this path (http_guards.py).

The server hands its routes object (`Serving`: the engine loop, the agent turns, the served model's
name, how it names adapters and tokenises); the route adds nothing to it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera.config.errors import RequestError, TesseraError
from tessera.config.json_text import parse_json
from tessera.infer.agents.options import AgentOptions
from tessera.infer.agents.turn import AgentTurn
from tessera.infer.agents.turn_plan import AgentTurns, TurnPlan
from tessera.infer.api.anthropic_messages import MessagesRequest, messages_request, refuse
from tessera.infer.api.anthropic_output import MessageEvents, error_body, message_object, sse, stop_reason, usage
from tessera.infer.api.openai_protocol import ProtocolError, new_id
from tessera.infer.engine.checked_request import CheckedRequest
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.engine.sequence import RequestOutput

# the engine's and the sampling parameters' names of a field, as the Messages API spells it
_FIELDS = {"prompt": "messages", "images": "messages", "adapter": "model", "stop": "stop_sequences"}


class Serving(Protocol):
    """What the route uses of the server's routes object (server.py's `_Routes`)."""

    loop: EngineLoop
    engine: Any
    tokenizer: Any
    model_name: str
    turns: AgentTurns

    def adapter_of(self, body: dict) -> str | None: ...

    def encode(self, prompt: str | list[int], special: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class _Prepared:
    request: MessagesRequest
    plan: TurnPlan
    checked: CheckedRequest
    model: str


def _refusal(e: TesseraError) -> JSONResponse:
    """A request refused: its status (400 unless the error says), the field as the API spells it; an
    error without a field is the chat template's (it renders the conversation)."""
    status = e.status if isinstance(e, ProtocolError) else 400
    field = e.field if isinstance(e, RequestError) else "messages"
    field = _FIELDS.get(field, field)
    return JSONResponse(error_body(str(e), status, field), status_code=status)


def _check_auto(turn: AgentTurn, options: AgentOptions) -> None:
    """`auto` (the default where tools are offered) needs the server to read calls, as on chat."""
    if turn.choice.mode == "auto" and not options.enable_auto_tool_choice:
        raise refuse("tool_choice", "tool_choice {'type': 'auto'} (the default where tools are offered) needs "
                     "the server started with --enable-auto-tool-choice and --tool-call-parser NAME; or send "
                     "{'type': 'any'}, {'type': 'tool', 'name': ...} or {'type': 'none'}")


def _prepare(serving: Serving, raw: bytes) -> _Prepared:
    """The request read, planned and checked (in a worker thread: the template renders, schemas compile)."""
    body = parse_json(raw, "request body", ProtocolError)
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    adapter = serving.adapter_of(body)
    request = messages_request(body)
    if serving.tokenizer is None:
        raise refuse("messages", "this model has no tokenizer, so no chat template to render messages with")
    _check_auto(request.turn, serving.turns.options)
    plan = serving.turns.prepare(request.turn)
    ids = serving.encode(plan.prompt, special=False)
    checked = serving.engine.check_request(ids, plan.sampling(request.params), adapter)
    return _Prepared(request, plan, checked, request.model or serving.model_name)


class _Outputs:
    """One request in the engine: its outputs as they come, aborted if left unfinished."""

    def __init__(self, loop: EngineLoop, checked: CheckedRequest):
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.loop, self.finished = loop, False
        event_loop = asyncio.get_running_loop()

        def deliver(out: RequestOutput) -> None:
            try:
                event_loop.call_soon_threadsafe(self.queue.put_nowait, out)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                pass
        self.rid = loop.submit_checked(checked, deliver)

    async def next(self, timeout: float | None = None) -> RequestOutput:
        out = await asyncio.wait_for(self.queue.get(), timeout)
        self.finished = out.finished
        return out

    def close(self) -> None:
        if not self.finished:
            self.loop.abort(self.rid)


def _failure(out: RequestOutput) -> tuple[str, int, str | None]:
    """A request that failed while generating: 400 when its own tool schema failed in the grammar
    engine, 500 when the server failed it."""
    if out.client_error:
        return f"generation failed: {out.error}", 400, "tools"
    return f"generation failed: {out.error}", 500, None


async def serve_messages(serving: Serving, request: Request) -> Response:
    """The route's handler."""
    try:
        prepared = await asyncio.to_thread(_prepare, serving, await request.body())
    except TesseraError as e:
        return _refusal(e)
    outputs = _Outputs(serving.loop, prepared.checked)
    message_id = new_id("msg").replace("-", "_")
    if prepared.request.stream:
        return StreamingResponse(_stream(outputs, prepared, message_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(request, outputs, prepared, message_id)


async def _whole(request: Request, outputs: _Outputs, prepared: _Prepared, message_id: str) -> Response:
    """The whole message; the request aborted if the client goes away first."""
    try:
        while True:
            try:
                out = await outputs.next(timeout=0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if out.finished:
                break
    finally:
        outputs.close()
    if out.finish_reason == "error":
        message, status, field = _failure(out)
        return JSONResponse(error_body(message, status, field), status_code=status)
    plan = prepared.plan
    read = plan.output(out)
    use = usage(out.prompt_tokens, len(out.token_ids), read.reasoning_tokens if plan.reads_reasoning else None,
                out.cached_tokens)
    return JSONResponse(message_object(message_id, prepared.model, read,
                                       stop_reason(read.finish_reason, out.stop_string), use))


async def _stream(outputs: _Outputs, prepared: _Prepared, message_id: str):
    """The message's events as server-sent events (anthropic_output.py)."""
    plan, decoder = prepared.plan, prepared.plan.decoder()
    events = MessageEvents(message_id, prepared.model, len(prepared.checked.prompt_ids))
    try:
        for event in events.start():
            yield sse(event)
        while True:
            out = await outputs.next()
            if out.finish_reason == "error":
                yield sse(error_body(*_failure(out)))  # the status line said 200 already
                return
            read = decoder.step(out)
            for event in events.step(read):
                yield sse(event)
            if out.finished:
                break
        use = usage(out.prompt_tokens, len(out.token_ids), decoder.reasoning_tokens if plan.reads_reasoning else None,
                    out.cached_tokens)
        for event in events.end(stop_reason(read.finish_reason, out.stop_string), use):
            yield sse(event)
    finally:
        outputs.close()
