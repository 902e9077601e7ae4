"""The answer to a completions or chat request once its choices are in the engine: collected whole
(`collect`: one JSON response when every choice has finished) or streamed (`stream`: server-sent
events, a chunk per step with new text, the finish reason last, usage if asked, then `[DONE]`).
Either way the choices' JSON comes from `Choices` (openai_choices.py), and a client that goes away
has its choices aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tessera.infer.api.openai_choices import Choices
from tessera.infer.api.openai_protocol import choice, chunk_object, completion_object, error_body
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.engine.sequence import RequestOutput


async def collect(request: Request, loop: EngineLoop, queue: asyncio.Queue, rids: list[str], rid: str, name: str,
                   choices: Choices) -> Response:
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
    failed = [o for o in done.values() if o.finish_reason == "error"]
    if failed:
        message, status, param = failure(failed[0], choices.constraint_field)
        return JSONResponse(error_body(message, status, param), status_code=status)
    outs = [done[i] for i in range(len(rids))]
    finals = [choices.final(i, o) for i, o in enumerate(outs)]
    firsts = [o for i, o in enumerate(outs) if i % choices.n == 0]  # each prompt once
    use = choices.usage(sum(o.prompt_tokens for o in firsts), sum(len(o.token_ids) for o in outs),
                        sum(o.cached_tokens for o in firsts))
    return JSONResponse(completion_object(rid, name, finals, use, choices.chat))


def failure(out: RequestOutput, constraint: str) -> tuple[str, int, str | None]:
    """Message, HTTP status and offending field of a request that failed while generating: 400
    when its own constraint (the field `constraint`) failed in the grammar engine, 500 when the
    server failed it."""
    if out.client_error:
        return f"generation failed: {out.error}", 400, constraint
    return f"generation failed: {out.error}", 500, None


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def stream(loop: EngineLoop, queue: asyncio.Queue, rids: list[str], rid: str, name: str, choices: Choices,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step with new text, the finish reason last, then [DONE]."""
    finished: set[int] = set()
    prompt_tokens = completion_tokens = cached_tokens = 0
    chat = choices.chat
    try:
        if chat:
            for i in range(len(rids)):
                yield sse(chunk_object(rid, name, [choice(i, "", None, chat, True, first=True)], chat))
        while len(finished) < len(rids):
            index, out = await queue.get()
            if out.finish_reason == "error":
                finished.add(index)
                yield sse(error_body(*failure(out, choices.constraint_field)))  # the status line said 200 already
                continue
            c = choices.chunk(index, out)
            if c is not None:
                yield sse(chunk_object(rid, name, [c], chat))
            if out.finished:
                finished.add(index)
                prompt_tokens += out.prompt_tokens if index % choices.n == 0 else 0
                cached_tokens += out.cached_tokens if index % choices.n == 0 else 0
                completion_tokens += len(out.token_ids)
        if include_usage:
            yield sse(chunk_object(rid, name, [], chat, choices.usage(prompt_tokens, completion_tokens, cached_tokens)))
        yield sse("[DONE]")
    finally:
        for i, r in enumerate(rids):
            if i not in finished:
                loop.abort(r)
