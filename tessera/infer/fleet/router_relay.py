"""The router's calls to the instances behind it, each bounded, and the guard against loops.

`Deadlines`: every call to a backend has three (`tessera router --backend-connect-timeout`,
`--backend-first-byte-timeout`, `--backend-timeout`): to connect, to the response's head (for an
answer that is not streamed, the whole generation), and to its last byte. A backend that misses
one is a 504, one that cannot be reached or breaks off an answer a 502; either names the backend
and, for a deadline, the option that sets it, so an operator knows which process to look at.

`relay` passes an answer on. A streamed one (server-sent events) goes event by event: a backend
that resets or outlives its deadline mid-stream ends the client's stream with an error event and
`[DONE]` (and the router's log with one line), never a half event or a stream that just stops. An
answer that is not streamed is read whole before it is passed on, so a reset is a clean 502.

`LoopGuard`: a router whose `--decode` or `--prefill` leads back to itself, directly or through
other routers, would forward a request to itself until something gave out. Each router has an id
and adds it to the `x-tessera-via` header of what it forwards; a request that arrives carrying the
router's own id, or more hops than any sane chain of routers, is a 508.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("tessera.router")

VIA_HEADER = "x-tessera-via"
MAX_HOPS = 8  # routers a request may pass through (a real chain has one or two)


@dataclass(frozen=True)
class Deadlines:
    """Seconds each call to a backend may take: to connect, to its response's head, in all."""

    connect_s: float = 10.0
    first_byte_s: float = 600.0
    whole_s: float = 3600.0


def error_body(message: str, status: int) -> dict:
    return {"error": {"message": message, "type": "server_error", "code": status}}


def backend_error(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


def _failure(e: BaseException, backend: str, deadlines: Deadlines, started: bool) -> tuple[str, int]:
    """What went wrong with a call to `backend`, in one line, and its status (504: a deadline)."""
    if isinstance(e, httpx.ConnectTimeout):
        return (f"{backend} did not accept a connection within {deadlines.connect_s:g} s "
                "(--backend-connect-timeout)"), 504
    if isinstance(e, TimeoutError):
        if started:
            return f"{backend} did not finish its answer within {deadlines.whole_s:g} s (--backend-timeout)", 504
        return (f"{backend} sent no response within {deadlines.first_byte_s:g} s "
                "(--backend-first-byte-timeout)"), 504
    what = "broke off its answer" if started else "is unreachable"
    return f"{backend} {what} ({type(e).__name__}: {str(e)[:200] or 'no detail'})", 502


async def relay(client: httpx.AsyncClient, upstream: httpx.Request, backend: str, deadlines: Deadlines) -> Response:
    """`upstream`'s answer from `backend`, passed on within `deadlines` (module docstring)."""
    end = time.monotonic() + deadlines.whole_s
    try:
        async with asyncio.timeout(min(deadlines.first_byte_s, deadlines.whole_s)):
            answer = await client.send(upstream, stream=True)
    except (httpx.HTTPError, TimeoutError) as e:
        message, status = _failure(e, backend, deadlines, started=False)
        log.warning("%s", message)
        return backend_error(message, status)
    media_type = answer.headers.get("content-type")
    if (media_type or "").startswith("text/event-stream"):
        return StreamingResponse(_events(answer, backend, deadlines, end), status_code=answer.status_code,
                                 media_type=media_type, headers={"Cache-Control": "no-cache"})
    try:
        async with asyncio.timeout_at(_loop_time(end)):
            content = await answer.aread()
    except (httpx.HTTPError, TimeoutError) as e:
        message, status = _failure(e, backend, deadlines, started=True)
        log.warning("%s", message)
        return backend_error(message, status)
    finally:
        await answer.aclose()
    return Response(content, status_code=answer.status_code, media_type=media_type)


def _loop_time(monotonic_deadline: float) -> float:
    """A `time.monotonic()` deadline on the event loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


async def _events(answer: httpx.Response, backend: str, deadlines: Deadlines, end: float) -> AsyncIterator[bytes]:
    """The backend's server-sent events, whole ones only; on a reset or the deadline an error event
    and `[DONE]` end the stream."""
    chunks, pending = answer.aiter_bytes(), b""
    try:
        while True:
            async with asyncio.timeout_at(_loop_time(end)):
                chunk = await anext(chunks, None)
            if chunk is None:
                break
            *events, pending = (pending + chunk).split(b"\n\n")
            for event in events:
                yield event + b"\n\n"
        if pending.strip():
            yield pending + b"\n\n"
    except (httpx.HTTPError, TimeoutError) as e:
        message, status = _failure(e, backend, deadlines, started=True)
        log.warning("%s; the client's stream ends with an error event", message)
        yield b"data: " + json.dumps(error_body(message, status)).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        await answer.aclose()


class LoopGuard:
    """This router's id on what it forwards; a 508 for what comes back (module docstring)."""

    def __init__(self):
        self.id = uuid.uuid4().hex[:16]

    def refusal(self, request: Request) -> Response | None:
        via = [hop.strip() for hop in request.headers.get(VIA_HEADER, "").split(",") if hop.strip()]
        if self.id in via:
            return backend_error("request loop: this request came back to this router (its --decode or --prefill "
                                 "leads back to it, directly or through other routers)", 508)
        if len(via) >= MAX_HOPS:
            return backend_error(f"request loop: this request passed {len(via)} routers already (at most "
                                 f"{MAX_HOPS})", 508)
        return None

    def headers(self, request: Request) -> dict[str, str]:
        """The via header to forward with `request`: the hops it came through, then this router."""
        via = request.headers.get(VIA_HEADER)
        return {VIA_HEADER: f"{via}, {self.id}" if via else self.id}
