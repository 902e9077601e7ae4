"""`tessera router --replica URL [--replica URL ...] --policy P`: one OpenAI-compatible front for
several `tessera serve` replicas of the same models.

POST /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages each go to one replica,
chosen by the policy among the healthy ones:
- `round_robin`: each in turn;
- `least_loaded`: the one with the fewest requests in flight through this router (ties: in turn);
- `cache_aware`: the one that was sent the longest prefix of this request's prompt (prefix_index.py),
  if that prefix is at least `min_match` of the prompt (a few shared characters, the start of every
  chat's JSON, say, do not count) and that replica has at most `balance_slack` requests in flight
  beyond the least loaded one; otherwise the least loaded one takes it. The index is corrected by
  the prefix-cache hits the replicas report in their answers' usage (`correct`): a replica that
  lost what it was sent stops attracting its prefixes.
A replica that cannot be reached, breaks off, answers something that is not HTTP or not JSON,
answers 502/503/504, or sends nothing within --backend-first-byte-timeout is taken out of service
and the request is tried on another replica (each at most once). A streamed answer is committed to
a replica at its first chunk: a replica lost after that ends the client's stream with an error
event and `[DONE]`, never a second answer after a first one's beginning. Health checks (GET /health
every `health_interval_s`) take replicas out and put them back, and read each one's /v1/models: a
request goes to the replicas that serve its `model` (while any does; a replica whose list is not
known yet may), so replicas of different models, or `tessera serve --model` servers, share a router.
GET /v1/models lists what the healthy replicas list (each id once); /health is 200 while one replica
is healthy; /metrics is the router's: per replica its requests, in flight, failures and health, the
policy's decisions and the prefix index's hit rate.
With a prefill pool (`--prefill URL ...` beside `--replica URL ...`, the replicas then decode
instances), a prefill instance (the least loaded, in turn) first computes each completion or chat
prompt and hands its blocks to the chosen replica, as the one-pair P/D router does (router.py's
`prefill_into`; a failed prefill costs the replica a recompute, never the request).
The guards, the client's API key passed on and the loop guard are the P/D router's (router.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from tessera.config.errors import ConfigError, RequestError
from tessera.config.json_text import parse_json
from tessera.infer.api.http_guards import DEFAULT_MAX_REQUEST_BYTES, add_guards, check_api_key
from tessera.infer.fleet.prefix_index import PrefixIndex, StreamUsage, prompt_text, reported_hit
from tessera.infer.fleet.router import prefill_into
from tessera.infer.fleet.router_relay import Deadlines, LoopGuard, backend_error, error_body
from tessera.infer.scheduling.kv_peer import require_peer_secret

log = logging.getLogger("tessera.router")
POLICIES = ("cache_aware", "round_robin", "least_loaded")
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
RETRY_STATUSES = frozenset({502, 503, 504})
PREFILL_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # what a prefill pool takes


class ReplicaFailed(Exception):
    """A replica failed a request before anything of its answer reached the client."""


@dataclass
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    models: frozenset[str] | None = None  # what its /v1/models lists (None: not known yet)
    prompt_tokens: int = 0  # of the answers that reported their prefix-cache hit
    cached_tokens: int = 0  # of those, found in its prefix cache


@dataclass
class Decisions:
    by_prefix: int = 0  # sent where their prefix was
    by_load: int = 0  # sent to the least loaded one (no prefix known, or its holder too busy)
    in_turn: int = 0  # round robin
    retries: int = 0
    unanswered: int = 0  # no replica could answer
    corrected: int = 0  # a replica reported a prefix-cache hit far below the index's: forgotten
    prefilled: int = 0  # with a prefill pool: prompts a prefill instance computed for the chosen replica
    prefill_fallbacks: int = 0  # ... and those the chosen replica computed itself (the prefill failed)
    counts: dict = field(default_factory=dict)


class ReplicaRouter:
    def __init__(self, urls: list[str], policy: str, deadlines: Deadlines, balance_slack: int = 4,
                 health_interval_s: float = 5.0, index: PrefixIndex | None = None, min_match: float = 0.5,
                 api_key: str | None = None, prefills: list[str] = (), kv_peer_secret: bytes | None = None,
                 prefill_timeout_s: float = 30.0):
        """`prefills`: a pool of `--kv-role prefill` instances in front of the replicas, which are then
        `--kv-role decode` instances (`prefill_into`, router.py), all sharing `kv_peer_secret`."""
        if policy not in POLICIES:
            raise ConfigError(f"--policy {policy!r} is invalid: allowed {', '.join(POLICIES)}")
        self.replicas = [Replica(url) for url in urls]
        self.prefills = [Replica(url) for url in prefills]
        self.kv_key = require_peer_secret(kv_peer_secret, "tessera router --prefill") if prefills else b""
        self.prefill_timeout_s = prefill_timeout_s
        self.policy, self.deadlines, self.balance_slack = policy, deadlines, balance_slack
        self.min_match = min_match  # the share of a prompt's chunks a replica must hold to be chosen for it
        self.health_interval_s = health_interval_s
        self.auth = {"authorization": f"Bearer {api_key}"} if api_key else {}  # for its own /v1/models calls
        self.index = index or PrefixIndex()
        self.turn = itertools.count()
        self.decisions, self.loops = Decisions(), LoopGuard()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=deadlines.connect_s))
        self._checker: asyncio.Task | None = None

    # ---- choosing ------------------------------------------------------------------------------
    def _in_turn(self, among: list[Replica]) -> Replica:
        return among[next(self.turn) % len(among)]

    def choose(self, keys: list[bytes], tried: list[Replica], model: str | None = None) -> tuple[Replica | None, int]:
        """The replica for a request for `model` with prefix `keys` (None: none left), and how many
        chunks of it that replica was sent before. Only replicas that serve `model` (or may: not
        known yet) are chosen, while any does."""
        healthy = [r for r in self.replicas if r.healthy and r not in tried]
        serving = [r for r in healthy if r.models is None or model in r.models]
        healthy = serving if model is not None and serving else healthy
        if not healthy:
            return None, 0
        if self.policy == "round_robin":
            self.decisions.in_turn += 1
            return self._in_turn(healthy), 0
        least = min(r.in_flight for r in healthy)
        if self.policy == "cache_aware":
            found = self.index.match(keys)
            held = [r for r in healthy if found.get(r.url, 0) >= self.min_match * len(keys)]
            if held and keys:
                best = max(held, key=lambda r: (found[r.url], -r.in_flight))
                if best.in_flight <= least + self.balance_slack:
                    self.decisions.by_prefix += 1
                    return best, found[best.url]
        self.decisions.by_load += 1
        return self._in_turn([r for r in healthy if r.in_flight == least]), 0

    def out_of_service(self, replica: Replica, why: str) -> None:
        replica.failures += 1
        if replica.healthy:
            log.warning("replica %s taken out of service: %s", replica.url, why)
        replica.healthy = False
        self.index.forget(replica.url)

    # ---- forwarding ----------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        if (loop := self.loops.refusal(request)) is not None:
            return loop
        raw = await request.body()
        headers = {**{k: v for k in ("authorization", "x-api-key", "anthropic-version")
                      if (v := request.headers.get(k))}, **self.loops.headers(request),
                   "content-type": "application/json"}
        model, keys = await asyncio.to_thread(self._read, raw)
        tried: list[Replica] = []
        while True:
            replica, matched = self.choose(keys, tried, model)
            if replica is None:
                break
            if tried:
                self.decisions.retries += 1
            tried.append(replica)
            if self.prefills and request.url.path in PREFILL_ENDPOINTS:
                await self._prefill(replica, PREFILL_ENDPOINTS[request.url.path], raw, headers)
            try:
                settle = self._settler(replica, keys, matched)
                answer = await self._send(replica, request.url.path, raw, headers, settle)
            except ReplicaFailed as e:
                self.out_of_service(replica, str(e))
                continue
            if isinstance(answer, StreamingResponse):  # its usage, if any, comes at its end (`_events`)
                if self.policy == "cache_aware":
                    self.index.record(keys, replica.url, matched)
            else:
                settle(reported_hit(answer.body) if answer.status_code == 200 else None)
            return answer
        self.decisions.unanswered += 1
        names = ", ".join(r.url for r in tried) or "none is healthy"
        return backend_error(f"no replica could answer (tried: {names})", 503)

    async def _prefill(self, decode: Replica, endpoint: str, raw: bytes, headers: dict) -> None:
        """A prefill instance (the least loaded healthy one, in turn) computes the prompt and hands its
        blocks to `decode`; if none can, `decode` computes it itself."""
        healthy = [r for r in self.prefills if r.healthy]
        least = min((r.in_flight for r in healthy), default=0)
        prefill = self._in_turn([r for r in healthy if r.in_flight == least]) if healthy else None
        done = False
        if prefill is not None:
            prefill.in_flight += 1
            prefill.requests += 1
            try:
                done = await prefill_into(self.client, prefill.url, decode.url, endpoint, raw, headers, self.kv_key,
                                          self.prefill_timeout_s)
            finally:
                prefill.in_flight -= 1
            prefill.failures += not done
        if done:
            self.decisions.prefilled += 1
        else:
            self.decisions.prefill_fallbacks += 1

    def _settler(self, replica: Replica, keys: list[bytes], matched: int):
        """What to do with the prefix-cache hit `replica` reports for a request (None: it said none):
        count it, forget the replica in the index when the hit is under half the share of the prompt
        the index expected there (prefix_index.py), and record the prompt as the replica's now
        (`recorded`: a stream's prompt was recorded when it started; again only after forgetting)."""
        def settle(hit: tuple[int, int] | None, recorded: bool = False) -> None:
            if hit is not None:
                replica.prompt_tokens += hit[0]
                replica.cached_tokens += hit[1]
            if self.policy != "cache_aware":
                return
            lost = hit is not None and matched > 0 and hit[1] / hit[0] < 0.5 * matched / len(keys)
            if lost:
                self.decisions.corrected += 1
                log.info("replica %s holds less of a prompt than it was sent (%d of %d tokens cached): forgotten "
                         "in the prefix index", replica.url, hit[1], hit[0])
                self.index.forget(replica.url)
            if lost or not recorded:
                self.index.record(keys, replica.url, matched, count=not recorded)
        return settle

    def _read(self, raw: bytes) -> tuple[str | None, list[bytes]]:
        """The request's `model` and, for the cache-aware policy, its prompt's prefix keys."""
        try:
            body = parse_json(raw, "request body", RequestError)
        except RequestError:
            return None, []  # the replica says what is wrong with it
        if not isinstance(body, dict):
            return None, []
        model = body.get("model") if isinstance(body.get("model"), str) else None
        return model, self.index.keys(prompt_text(body)) if self.policy == "cache_aware" else []

    async def _send(self, replica: Replica, path: str, raw: bytes, headers: dict, settle) -> Response:
        """`replica`'s answer; ReplicaFailed before anything of it is committed to the client."""
        replica.in_flight += 1
        replica.requests += 1
        streaming = False
        try:
            upstream = self.client.build_request("POST", replica.url + path, content=raw, headers=headers)
            async with asyncio.timeout(self.deadlines.first_byte_s):
                answer = await self.client.send(upstream, stream=True)
                if answer.status_code in RETRY_STATUSES:
                    await answer.aclose()
                    raise ReplicaFailed(f"answered {answer.status_code}")
                media_type = answer.headers.get("content-type") or ""
                chunks = answer.aiter_bytes()
                if media_type.startswith("text/event-stream"):
                    first = await anext(chunks, b"")
                    streaming = True
                    return StreamingResponse(self._events(replica, answer, first, chunks, settle),
                                             status_code=answer.status_code, media_type=media_type,
                                             headers={"Cache-Control": "no-cache"})
            async with asyncio.timeout(self.deadlines.whole_s):
                content = await answer.aread()
            await answer.aclose()
            if media_type.startswith("application/json"):
                try:
                    json.loads(content)
                except ValueError:
                    raise ReplicaFailed("answered a body that is not JSON") from None
            return Response(content, status_code=answer.status_code, media_type=media_type or None)
        except (httpx.HTTPError, TimeoutError) as e:
            raise ReplicaFailed(f"{type(e).__name__}: {str(e)[:200] or 'no detail'}") from None
        finally:
            if not streaming:
                replica.in_flight -= 1

    async def _events(self, replica: Replica, answer: httpx.Response, first: bytes,
                      chunks: AsyncIterator[bytes], settle) -> AsyncIterator[bytes]:
        """The stream from its first chunk on; a replica lost now ends it with an error event. Its
        events are read as they pass for the usage a stream may end with (`stream_options.include_usage`,
        a Responses stream's last event), however long the event that carries it."""
        usage = StreamUsage()
        try:
            usage.feed(first)
            yield first
            async with asyncio.timeout(self.deadlines.whole_s):
                async for chunk in chunks:
                    usage.feed(chunk)
                    yield chunk
            settle(usage.finish(), recorded=True)
        except (httpx.HTTPError, TimeoutError) as e:
            message = f"replica {replica.url} broke off its answer ({type(e).__name__})"
            self.out_of_service(replica, message)
            yield b"\n\ndata: " + json.dumps(error_body(message, 502)).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            replica.in_flight -= 1
            await answer.aclose()

    # ---- health --------------------------------------------------------------------------------
    async def check_health(self) -> None:
        async def one(replica: Replica) -> None:
            try:
                r = await self.client.get(replica.url + "/health", timeout=self.deadlines.connect_s)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                self.out_of_service(replica, "its /health check failed")
                return
            if not replica.healthy:
                log.info("replica %s is back in service", replica.url)
                replica.healthy = True
            replica.models = await self._models_of(replica)
        await asyncio.gather(*(one(r) for r in [*self.replicas, *self.prefills]))

    async def _models_of(self, replica: Replica) -> frozenset[str] | None:
        try:
            r = await self.client.get(replica.url + "/v1/models", timeout=self.deadlines.connect_s,
                                      headers=self.auth)
            return frozenset(m["id"] for m in r.json()["data"] if isinstance(m.get("id"), str))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return replica.models  # unknown (or behind a key the router lacks): as before

    async def _check_forever(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval_s)

    def start(self) -> None:
        if self._checker is None:
            self._checker = asyncio.ensure_future(self._check_forever())

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
        await self.client.aclose()

    # ---- the other routes ----------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        """Every model the healthy replicas list, each id once (the first replica's entry)."""
        headers = {k: v for k in ("authorization", "x-api-key") if (v := request.headers.get(k))}
        seen: dict[str, dict] = {}
        answered = None
        for replica in [r for r in self.replicas if r.healthy]:
            try:
                r = await self.client.get(replica.url + "/v1/models", timeout=self.deadlines.connect_s,
                                          headers=headers)
                data = r.json()["data"] if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                self.out_of_service(replica, type(e).__name__)
                continue
            if data is None:  # a refusal (the API key, say): passed on as it is
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
            answered = True
            for entry in data:
                seen.setdefault(str(entry.get("id")), entry)
        if answered is None:
            return backend_error("no replica is healthy", 503)
        return Response(json.dumps({"object": "list", "data": list(seen.values())}), media_type="application/json")

    async def health(self, _request: Request) -> Response:
        if any(r.healthy for r in self.replicas):
            return Response(b'{"status": "ok"}', media_type="application/json")
        return backend_error("no replica is healthy", 503)

    async def metrics(self, _request: Request) -> Response:
        lines = []
        per_replica = [("router_replica_requests_total", "counter", "Requests sent to the replica.", "requests"),
                       ("router_replica_in_flight", "gauge", "Requests in flight at the replica.", "in_flight"),
                       ("router_replica_failures_total", "counter", "Requests the replica failed.", "failures"),
                       ("router_replica_healthy", "gauge", "1 while the replica is in service.", "healthy"),
                       ("router_replica_prompt_tokens_total", "counter", "Prompt tokens of answers reporting "
                        "their prefix-cache hit.", "prompt_tokens"),
                       ("router_replica_cached_tokens_total", "counter", "Of those, found in the replica's "
                        "prefix cache.", "cached_tokens")]
        for name, kind, doc, attr in per_replica:
            lines += [f"# HELP tessera_{name} {doc}", f"# TYPE tessera_{name} {kind}"]
            lines += [f'tessera_{name}{{replica="{r.url}"}} {int(getattr(r, attr))}'
                      for r in [*self.replicas, *self.prefills]]
        d = self.decisions
        lines += ["# HELP tessera_router_decisions_total Routing decisions, by reason.",
                  "# TYPE tessera_router_decisions_total counter"]
        lines += [f'tessera_router_decisions_total{{reason="{k}"}} {v}' for k, v in
                  (("prefix", d.by_prefix), ("load", d.by_load), ("turn", d.in_turn), ("retry", d.retries),
                   ("unanswered", d.unanswered), ("corrected", d.corrected), ("prefilled", d.prefilled),
                   ("prefill_fallback", d.prefill_fallbacks))]
        lines += ["# HELP tessera_router_prefix_hit_rate Prompt chunks found at the chosen replica.",
                  "# TYPE tessera_router_prefix_hit_rate gauge",
                  f"tessera_router_prefix_hit_rate {self.index.hit_rate}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def create_replica_router(router: ReplicaRouter, api_key: str | None = None,
                          allowed_hosts: frozenset[str] | None = None,
                          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The routes of `router` behind the server's guards."""
    check_api_key(api_key)
    app = FastAPI(title="Tessera router", docs_url=None, redoc_url=None)
    add_guards(app, api_key, allowed_hosts, max_request_bytes)
    for path in PATHS:
        app.add_api_route(path, router.generate, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route("/health", router.health, methods=["GET"])
    app.add_api_route("/metrics", router.metrics, methods=["GET"])
    app.router.add_event_handler("startup", router.start)
    app.router.add_event_handler("shutdown", router.stop)
    app.state.router = router
    return app
