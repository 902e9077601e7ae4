"""The HTTP side of a serving profile (`tessera serve --profile-dir DIR`): while the engine records
(between POST /profile/start and /profile/stop), each HTTP request the server answers is timed in
its parts by an ASGI middleware, the outermost, so that every other layer's work counts:

    read_s    reading the request's body from the server (the `receive` calls until it is whole)
    parse_s   from the body read to the request queued in the engine: JSON decoding, validation, the
              chat template and tokenizing (to the answer's start when no engine request was made,
              as for a refused request)
    engine_s  from queued to the engine's final output for it (its last one, for n > 1): queueing,
              prefill and decode; a streamed answer's chunks are formatted and written within it
    write_s   from the engine's final output to the last byte handed to the server: waking the
              handler, formatting the answer (a whole JSON body, or a stream's last events) and
              writing it

which add up to the request's time in the app (`t1 - t0`); `send_s` is the part of it spent inside the
server's `send` (the status line, headers and body chunks written to the connection). The request's
engine requests (`ids`) tie it to their lives in engine.jsonl (step_profile.py, where the engine
side notes its times). A request that started before the session or ended after it is not recorded.
"""

from __future__ import annotations

import time
from typing import Any

from tessera.infer.engine.step_profile import HTTP_REQUEST, EngineProfile, HttpRecord

SKIPPED = ("/profile/start", "/profile/stop")


class HttpProfile:
    """ASGI middleware adding one line per recorded HTTP request to `profile.http`."""

    def __init__(self, app, profile: EngineProfile):
        self.app, self.profile = app, profile

    async def __call__(self, scope, receive, send) -> None:
        profile = self.profile
        if scope["type"] != "http" or not profile.recording or scope.get("path") in SKIPPED:
            await self.app(scope, receive, send)
            return
        session, record = profile.sessions, HttpRecord(t0=time.monotonic())
        times: dict[str, Any] = {"read": 0.0, "send": 0.0, "body_at": None, "start_at": None, "status": None}

        async def timed_receive():
            t = time.monotonic()
            message = await receive()
            if times["body_at"] is None:
                times["read"] += time.monotonic() - t
                if message.get("type") != "http.request" or not message.get("more_body", False):
                    times["body_at"] = time.monotonic()
            return message

        async def timed_send(message):
            t = time.monotonic()
            if message.get("type") == "http.response.start":
                times["start_at"], times["status"] = t, message.get("status")
            await send(message)
            times["send"] += time.monotonic() - t

        token = HTTP_REQUEST.set(record)
        try:
            await self.app(scope, timed_receive, timed_send)
        finally:
            HTTP_REQUEST.reset(token)
            t1 = time.monotonic()
            if profile.recording and profile.sessions == session:
                profile.http.append(http_line(scope.get("path", ""), record, times, t1))


def http_line(path: str, record: HttpRecord, times: dict[str, Any], t1: float) -> dict[str, Any]:
    """The request's parts (the module docstring); each boundary clamped into [t0, t1] in order."""
    def within(t: float | None, after: float) -> float:
        return after if t is None else min(max(t, after), t1)

    read_end = within(times["body_at"] if times["body_at"] is not None else record.t0 + times["read"], record.t0)
    if record.submitted is None:  # no engine request: parsing lasts until the answer starts
        queued = answered = within(times["start_at"] if times["start_at"] is not None else t1, read_end)
    else:
        queued = within(record.submitted, read_end)
        answered = within(record.answered if record.answered is not None else t1, queued)
    return {"path": path, "status": times["status"], "t0": record.t0, "t1": t1, "read_s": read_end - record.t0,
            "parse_s": queued - read_end, "engine_s": answered - queued, "write_s": t1 - answered,
            "send_s": times["send"], "ids": list(record.ids)}
