"""`tessera router`: prefill/decode disaggregation in front of two `tessera serve` instances.

For each POST /v1/completions or /v1/chat/completions the router
1. asks the prefill instance (`--kv-role prefill`) to compute the prompt (POST /v1/kv/prefill) and
   receives the KV blocks of its full prefix blocks;
2. hands them to the decode instance (`--kv-role decode`, POST /v1/kv/import), into its host tier;
3. sends the request itself to the decode instance, which finds the prompt's prefix there, computes
   the rest and answers; the answer (streamed or not) is passed back unchanged.
Steps 1-2 are an optimisation: if the prefill instance is down, slow past `prefill_timeout`, or
answers an error, or the import fails, the decode instance computes the prompt itself (counted in
`tessera_router_prefill_fallbacks_total`). A request whose body is not JSON goes straight to the
decode instance, which says what is wrong with it. GET /v1/models and /health are the decode
instance's; /metrics is the router's own.

Each call to an instance has deadlines (connect, response head, whole answer); a missed one is a
504, an instance that cannot be reached or breaks off its answer a 502, each naming the instance; a
streamed answer broken off ends with an error event. A request that comes back to the router (its
`--decode` or `--prefill` leading back to it) is a 508 (router_relay.py).

The client's Authorization (or x-api-key) header is passed on to both instances: give the three
processes the same `--api-key`. The router has the server's guards (Host allow-list, body limit, API key). The KV
transfer itself is authenticated apart from the API key (kv_peer.py): the router signs its prefill
requests with the KV peer secret the three processes share, and the decode instance takes only
blocks the prefill instance made with it; the router needs the secret to start.
"""

from __future__ import annotations

import logging
import urllib.parse
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from tessera.config.errors import ConfigError, RequestError
from tessera.config.json_text import parse_json
from tessera.infer.api.http_guards import (
    DEFAULT_MAX_REQUEST_BYTES,
    add_guards,
    check_api_key,
    is_loopback,
)
from tessera.infer.fleet.router_relay import Deadlines, LoopGuard, backend_error, relay
from tessera.infer.scheduling.kv_peer import PEER_SIGNATURE_HEADER, require_peer_secret, sign_prefill_request

log = logging.getLogger("tessera.router")


@dataclass
class RouterCounters:
    requests: int = 0
    prefilled: int = 0  # requests whose blocks reached the decode instance
    fallbacks: int = 0  # requests the decode instance computed alone

    def prometheus(self) -> str:
        rows = {"router_requests_total": (self.requests, "Generation requests routed."),
                "router_prefilled_total": (self.prefilled, "Requests whose prompt the prefill instance computed."),
                "router_prefill_fallbacks_total": (self.fallbacks,
                                                   "Requests the decode instance computed alone (prefill failed).")}
        lines = []
        for name, (value, doc) in rows.items():
            lines += [f"# HELP tessera_{name} {doc}", f"# TYPE tessera_{name} counter", f"tessera_{name} {value}"]
        return "\n".join(lines) + "\n"


def _upstream(url: str, option: str) -> str:
    allowed = "an http:// or https:// URL of a `tessera serve` instance, with a port in 1..65535 if any"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{option} {url!r} is invalid: {allowed}")
    return url.rstrip("/")


def check_backends(prefill_url: str, decode_url: str, host: str, port: int) -> None:
    """ConfigError for a backend URL that is invalid or is the router's own address (`host`:`port`,
    as it binds them), before the router listens: a router forwarding to itself is a loop."""
    check_urls([(prefill_url, "--prefill"), (decode_url, "--decode")], host, port)


def check_urls(backends: list[tuple[str, str]], host: str, port: int) -> list[str]:
    """`check_backends` for (URL, option) pairs (the --replica URLs too); the URLs, checked."""
    everywhere = host in ("0.0.0.0", "::", "")
    for url, option in backends:
        parts = urllib.parse.urlsplit(_upstream(url, option))
        target = parts.port or (443 if parts.scheme == "https" else 80)
        same_host = parts.hostname == host or (is_loopback(parts.hostname) and (everywhere or is_loopback(host)))
        if port and target == port and same_host:
            raise ConfigError(f"{option} {url} is this router's own address (it listens on {host}:{port}): give the "
                              "URL of a `tessera serve` instance")
    return [_upstream(url, option) for url, option in backends]


def create_router(prefill_url: str, decode_url: str, prefill_timeout: float = 30.0, api_key: str | None = None,
                  allowed_hosts: frozenset[str] | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                  kv_peer_secret: bytes | None = None, deadlines: Deadlines | None = None) -> FastAPI:
    """The router's app; `deadlines` bound each call to an instance (router_relay.py)."""
    check_api_key(api_key)
    if not prefill_timeout > 0:
        raise ConfigError(f"--prefill-timeout {prefill_timeout} is invalid: must be > 0 seconds")
    prefill, decode = _upstream(prefill_url, "--prefill"), _upstream(decode_url, "--decode")
    routes = _Routes(prefill, decode, prefill_timeout, deadlines or Deadlines(), require_peer_secret(kv_peer_secret,
                                                                                      "tessera router"))
    app = FastAPI(title="Tessera router", docs_url=None, redoc_url=None)
    add_guards(app, api_key, allowed_hosts, max_request_bytes)

    async def completions(request: Request) -> Response:
        return await routes.generate(request, "completions", "/v1/completions")

    async def chat(request: Request) -> Response:
        return await routes.generate(request, "chat", "/v1/chat/completions")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/models", routes.passthrough, methods=["GET"])
    app.add_api_route("/health", routes.passthrough, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.router.add_event_handler("shutdown", routes.client.aclose)
    app.state.counters = routes.counters
    return app


async def prefill_into(client: httpx.AsyncClient, prefill: str, decode: str, endpoint: str, raw: bytes,
                       headers: dict[str, str], kv_key: bytes, timeout: float) -> bool:
    """Steps 1-2 (module docstring): the instance at `prefill` computes the prompt of the request
    `raw` ("completions" or "chat" `endpoint`), the one at `decode` takes its blocks; False when the
    decode instance has to compute the prompt itself."""
    try:
        inner = parse_json(raw, "request body", RequestError)  # the decode instance says what is wrong
    except RequestError:
        return False
    if not isinstance(inner, dict):
        return False
    try:
        # the client's bytes as they came (written back from `inner`, a deep document could break json.dumps)
        body = b'{"endpoint": "' + endpoint.encode() + b'", "request": ' + raw + b"}"
        r = await client.post(f"{prefill}/v1/kv/prefill", content=body, timeout=timeout,
                              headers={**headers, "content-type": "application/json",
                                       PEER_SIGNATURE_HEADER: sign_prefill_request(kv_key, body)})
        if r.status_code != 200:
            log.warning("prefill instance %s answered %d: %s", prefill, r.status_code, r.text[:200])
            return False
        r = await client.post(f"{decode}/v1/kv/import", content=r.content, timeout=timeout,
                              headers={**headers, "content-type": "application/octet-stream"})
        if r.status_code != 200:
            log.warning("decode instance %s refused the blocks (%d): %s", decode, r.status_code, r.text[:200])
            return False
    except httpx.HTTPError as e:
        log.warning("prefill/transfer failed (%s: %s); the decode instance computes the prompt",
                    type(e).__name__, e)
        return False
    return True


def _auth(request: Request) -> dict[str, str]:
    """The client's API key headers (either the guard takes), to pass on."""
    return {k: v for k in ("authorization", "x-api-key") if (v := request.headers.get(k))}


class _Routes:
    def __init__(self, prefill: str, decode: str, prefill_timeout: float, deadlines: Deadlines, kv_key: bytes):
        self.prefill, self.decode, self.prefill_timeout, self.deadlines = prefill, decode, prefill_timeout, deadlines
        self.kv_key = kv_key  # the KV peer secret: signs the requests to the prefill instance
        self.counters, self.loops = RouterCounters(), LoopGuard()
        # reads are bounded by `relay`'s deadlines; a connection by the connect deadline
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=deadlines.connect_s))

    async def prefill_first(self, endpoint: str, raw: bytes, headers: dict[str, str]) -> bool:
        """Steps 1-2; False when the decode instance has to compute the prompt itself."""
        return await prefill_into(self.client, self.prefill, self.decode, endpoint, raw, headers, self.kv_key,
                                  self.prefill_timeout)

    async def generate(self, request: Request, endpoint: str, path: str) -> Response:
        if (loop := self.loops.refusal(request)) is not None:
            return loop
        raw, headers = await request.body(), {**_auth(request), **self.loops.headers(request)}
        self.counters.requests += 1
        if await self.prefill_first(endpoint, raw, headers):
            self.counters.prefilled += 1
        else:
            self.counters.fallbacks += 1
        upstream = self.client.build_request("POST", f"{self.decode}{path}", content=raw,
                                             headers={**headers, "content-type": "application/json"})
        return await relay(self.client, upstream, f"decode instance {self.decode}", self.deadlines)

    async def passthrough(self, request: Request) -> Response:
        if (loop := self.loops.refusal(request)) is not None:
            return loop
        try:
            r = await self.client.get(f"{self.decode}{request.url.path}", timeout=self.prefill_timeout,
                                      headers={**_auth(request), **self.loops.headers(request)})
        except httpx.HTTPError as e:
            return backend_error(f"decode instance {self.decode} is unreachable ({type(e).__name__})", 503)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def metrics(self, _request: Request) -> Response:
        return PlainTextResponse(self.counters.prometheus(), media_type="text/plain; version=0.0.4")
