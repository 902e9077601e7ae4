"""The end of a request that outlives the server's graceful shutdown.

On SIGTERM or Ctrl-C uvicorn stops accepting connections and gives the requests in flight
`timeout_graceful_shutdown` seconds; then it cancels their tasks, and each cancellation reaches
uvicorn as an exception it logs with a traceback ("Exception in ASGI application") before a bare
500. A text request rarely outlives the grace period, but a vision-language request can: its image
is fetched and decoded before the engine sees it (up to --media-fetch-timeout per read), and the
encoder runs in its first step. `EndCancelledRequests` ends such a request as the server's own
decision, in one log line: a 503 saying the server is shutting down when no response has started,
the end of the body when one has (a stream ends cleanly).
"""

from __future__ import annotations

import asyncio
import json
import logging

from tessera.infer.api.http_guards import error_body

log = logging.getLogger("tessera.serve")
SHUTTING_DOWN = "the server is shutting down: the request did not finish within its graceful shutdown"


class EndCancelledRequests:
    """A plain ASGI wrapper (module docstring). A client that disconnects does not cancel its task
    (the app is told by `http.disconnect`), so a cancellation reaching here is the server's."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = {"started": False, "complete": False}

        async def tracked(message) -> None:
            if message["type"] == "http.response.start":
                sent["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            log.warning("%s %s cancelled: %s", scope.get("method", ""), scope.get("path", ""), SHUTTING_DOWN)
            await _end(send, sent, scope.get("path", ""))


async def _end(send, sent: dict, path: str) -> None:
    """A 503 (in the shape of the API at `path`) when nothing was sent, the end of the body when a
    response started but did not end."""
    try:
        if not sent["started"]:
            body = json.dumps(error_body(path, SHUTTING_DOWN, 503)).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
        elif not sent["complete"]:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except (asyncio.CancelledError, OSError, RuntimeError):
        pass  # the connection is gone already: nothing left to end
