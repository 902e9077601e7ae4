"""ASGI guards in front of the HTTP API, checked before any route runs.

- `HostCheck`: refuses a `Host` header outside an allow-list with 400. A page on an attacker's
  domain can make a browser send requests to a server on 127.0.0.1 by re-pointing its own DNS
  name there (DNS rebinding); the browser still sends the attacker's name as `Host`, so a
  loopback-bound server that only answers loopback names is out of its reach.
- `BodyLimit`: refuses a request body over `max_bytes` with 413, from `Content-Length` before a
  byte of the body is read, or as soon as a chunked body passes the limit. The body it lets
  through is handed to the app in one piece.
- `APIKeyCheck`: `/v1` routes and `/metrics` need `Authorization: Bearer <key>` or `x-api-key: <key>`
  (the header Anthropic's clients send); `/health` stays open for liveness probes.

A refusal is an OpenAI-style error body, or Anthropic's on the Messages API's path (anthropic_output.py).

Each is a plain ASGI wrapper, not Starlette's BaseHTTPMiddleware, which would hide client
disconnects from the streaming handlers.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from tessera.config.errors import ConfigError
from tessera.infer.api import anthropic_output, openai_protocol

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # 8 MiB: a 128k-token prompt as text or as ids fits easily


def error_body(path: str, message: str, status: int) -> dict:
    """The error object of the API served at `path`: Anthropic's on the Messages API's, else OpenAI's."""
    api = anthropic_output if path == anthropic_output.MESSAGES_PATH else openai_protocol
    return api.error_body(message, status)


def _reply(message: str, status: int, path: str = ""):
    """An ASGI app answering a JSON error in the shape of the API at `path` (kept free of web-framework
    imports, so that `tessera --help` does not load one)."""
    body = json.dumps(error_body(path, message, status)).encode()

    async def app(_scope, _receive, send) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    return app


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(option: str | None, bind_host: str) -> frozenset[str] | None:
    """The Host names to answer (None: any). `option` is the comma list of `--allowed-hosts`
    ('*' allows any); without it a loopback-bound server answers only loopback names and a server
    bound to another address answers any name (its public names are not known here)."""
    if option is None:
        if is_loopback(bind_host):
            return LOOPBACK_NAMES | {bind_host.lower().strip("[]")}
        return None
    names = [n.strip().lower() for n in option.split(",")]
    if "*" in names:
        return None
    names = [n.strip("[]") for n in names if n]
    if not names:
        raise ConfigError(f"--allowed-hosts {option!r} is invalid: give a comma list of host names, or '*' for any")
    return frozenset(names)


def host_name(header: bytes) -> str:
    """The name part of a Host header: 'example.com:8000' -> 'example.com', '[::1]:80' -> '::1'."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class HostCheck:
    def __init__(self, app, allowed: frozenset[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"")
            if host_name(header) not in self.allowed:
                await _reply("this server does not answer to that Host header (see --allowed-hosts)", 400,
                             scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Bodies up to `max_bytes`, or `path_limits[path]` on the paths it names."""

    def __init__(self, app, max_bytes: int, path_limits: dict[str, int] | None = None):
        self.app, self.max_bytes, self.path_limits = app, max_bytes, path_limits or {}

    def _too_large(self, limit: int, path: str):
        return _reply(f"request body is larger than the server's limit of {limit} bytes "
                      "(--max-request-bytes)", 413, path)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(limit, scope.get("path", ""))(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            size += len(message.get("body", b""))
            if size > limit:
                await self._too_large(limit, scope.get("path", ""))(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # from now on: http.disconnect when the client leaves

        await self.app(scope, replay, send)


class APIKeyCheck:
    def __init__(self, app, api_key: str, also: frozenset[str] = frozenset()):
        """`also`: paths outside /v1 that need the key too (the sleep routes of several models)."""
        self.app, self.bearer, self.key, self.also = app, f"Bearer {api_key}".encode(), api_key.encode(), also

    def authorised(self, headers: dict[bytes, bytes]) -> bool:
        """Whether `Authorization: Bearer <key>` or `x-api-key: <key>` carries the key (both compared
        in constant time, whichever is sent)."""
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
        header = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
        return bearer or header

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith(("/v1", "/profile/")) or path == "/metrics"
                                        or path in self.also):
            if not self.authorised(dict(scope["headers"])):
                await _reply("missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                             401, path)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_api_key(api_key: str | None) -> None:
    """An API key that is set must not be empty: an empty one would read as "no key" and leave
    the server open while its operator believes it is protected."""
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty (or $TESSERA_API_KEY is set to an empty string): give a "
                          "non-empty key, or unset it to serve without one")


def add_guards(app, api_key: str | None, allowed_hosts: frozenset[str] | None, max_request_bytes: int,
               path_limits: dict[str, int] | None = None, key_also: frozenset[str] = frozenset()) -> None:
    """The guards every app of a server or router passes, outermost last: the Host first, then the
    key, then the body is read (only for the authorised)."""
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, path_limits=path_limits)
    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key, also=key_also)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)
