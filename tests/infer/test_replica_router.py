"""`tessera router --replica URL ... --policy P` (tessera/infer/fleet/replica_router.py) over real
HTTP on 127.0.0.1: with three `tessera serve` replicas of a tiny model, cache-aware routing keeps
each conversation (a shared system prompt, turn after turn) on one replica and spreads the
conversations; round-robin takes the replicas in turn; least-loaded sends each request to a replica
with nothing in flight (replicas that hold requests until released make the load certain); a replica
that is gone, hangs up, hangs or answers garbage costs a retry on another replica, and the answer is
the model's own, streamed or not; one lost mid-stream ends that stream with an error event (no
second answer after the first one's start); a request goes to the replicas that serve its model;
bad options exit 2."""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tessera.cli import main as tessera_main
from tessera.infer.config import EngineConfig
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.fleet.prefix_index import PrefixIndex
from tessera.infer.fleet.replica_router import ReplicaRouter, create_replica_router
from tessera.infer.fleet.router_relay import Deadlines
from tests.hang_guard import HANG_S
from tests.infer.kv_messages import PEER_SECRET
from tests.infer.odd_replicas import ANSWER, OddReplica
from tests.infer.running_server import AppServer, RunningServer

SYSTEMS = ["You are a terse pirate who answers in riddles about the sea.",
           "You are a careful librarian who cites every shelf and row.",
           "You are a cheerful gardener who speaks only of tomatoes."]


@pytest.fixture(scope="module")
def replicas(llama):
    servers = [RunningServer(LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, max_num_seqs=8,
                                                                       kv_cache_gib=0.001)))
               for _ in range(3)]
    for s in servers:
        s.__enter__()
    yield servers
    for s in servers:
        s.__exit__(None, None, None)


class RunningRouter(AppServer):
    def __init__(self, urls: list[str], policy: str, first_byte_s: float = HANG_S, health_interval_s: float = 0.2,
                 prefills: list[str] = ()):
        self.router = ReplicaRouter(urls, policy, Deadlines(5.0, first_byte_s, HANG_S),
                                    health_interval_s=health_interval_s,
                                    index=PrefixIndex(chunk_chars=16), prefills=prefills,
                                    kv_peer_secret=PEER_SECRET if prefills else None)
        super().__init__(create_replica_router(self.router))


def _finished(server: RunningServer) -> int:
    return sum(server.engine.metrics.requests_finished.values())


def _chat(url: str, messages: list[dict], stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=HANG_S)


def _where(replicas, send) -> tuple[int, httpx.Response]:
    """Which replica answered `send()` (the one whose finished requests grew), and the answer."""
    before = [_finished(s) for s in replicas]
    r = send()
    assert r.status_code == 200, r.text
    grew = [k for k, s in enumerate(replicas) if _finished(s) > before[k]]
    assert len(grew) == 1, grew
    return grew[0], r


def test_cache_aware_keeps_each_conversation_on_one_replica(replicas):
    with RunningRouter([s.url for s in replicas], "cache_aware") as router:
        history = {k: [{"role": "system", "content": system}] for k, system in enumerate(SYSTEMS)}
        landed: dict[int, set[int]] = {k: set() for k in history}
        for turn in range(3):
            for k, messages in history.items():
                messages.append({"role": "user", "content": f"question {turn} of {k}"})
                where, r = _where(replicas, lambda m=messages: _chat(router.url, m))
                answer = r.json()["choices"][0]["message"]["content"]
                direct = _chat(replicas[(where + 1) % 3].url, messages).json()["choices"][0]["message"]["content"]
                assert answer == direct  # the model's own answer, whichever replica gave it
                messages.append({"role": "assistant", "content": answer})
                landed[k].add(where)
        assert all(len(places) == 1 for places in landed.values()), landed
        assert len({next(iter(places)) for places in landed.values()}) == 3  # spread over the replicas
        metrics = httpx.get(router.url + "/metrics").text
        assert 'tessera_router_decisions_total{reason="prefix"} 6' in metrics


def _cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_replica_that_lost_its_cache_stops_attracting_its_prefixes(replicas):
    """Two conversations sent to one replica; that replica loses its prefix cache (put to sleep and
    woken: the KV cache comes back empty). The next turn of the first still goes there (the index
    cannot know yet), the replica reports no cached tokens, and the router forgets it: the second
    conversation's next turn is placed by load, not by a prefix the replica no longer holds. A
    replica that keeps its cache reports the hit and is not corrected; a stream's usage (at its end)
    corrects the index too."""
    two = replicas[:2]
    talks = [[{"role": "system", "content": f"You are assistant number {k} of the forgetful replica test."},
              {"role": "user", "content": "first question"}] for k in range(3)]
    with RunningRouter([s.url for s in two], "cache_aware") as router:
        placed = [_where(two, lambda m=m: _chat(router.url, m))[0] for m in talks]
        assert placed[0] == placed[2] != placed[1], placed  # by load, in turn: 0 and 2 share a replica
        for m in talks:
            m += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second question"}]
        kept, r = _where(two, lambda: _chat(router.url, talks[1]))  # its replica kept its cache
        assert kept == placed[1] and _cached(r) > 0
        assert router.router.decisions.corrected == 0
        lost = two[placed[0]]
        for route in ("/sleep", "/wake_up"):
            assert httpx.post(lost.url + route, params={"level": 1}, timeout=HANG_S).status_code == 200
        where, r = _where(two, lambda: _chat(router.url, talks[0]))
        assert where == placed[0] and _cached(r) == 0  # predicted there, found nothing there
        assert router.router.decisions.corrected == 1
        by_prefix = router.router.decisions.by_prefix
        _where(two, lambda: _chat(router.url, talks[2]))
        assert router.router.decisions.by_prefix == by_prefix  # not sent by a prefix the replica lost
        metrics = httpx.get(router.url + "/metrics").text
        assert 'tessera_router_decisions_total{reason="corrected"} 1' in metrics
        name = f'tessera_router_replica_cached_tokens_total{{replica="{two[placed[1]].url}"}}'
        assert _metric(metrics, name) > 0  # the hits the replica that kept its cache reported

        holder = two[placed[1]]  # now it loses its cache, and the report comes at the end of a stream
        for route in ("/sleep", "/wake_up"):
            assert httpx.post(holder.url + route, params={"level": 1}, timeout=HANG_S).status_code == 200
        talks[1] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "third question"}]
        body = {"model": "tiny", "messages": talks[1], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=HANG_S) as stream:
            events = [line for line in stream.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert router.router.decisions.corrected == 2


def test_a_prefill_pool_computes_the_prompts_of_the_decode_replicas(llama):
    """`--prefill URL --prefill URL` beside `--replica URL ...`: each request's prompt is computed by a
    prefill instance (in turn) and its blocks handed to the decode replica the policy chose, whose
    answer is the model's own."""
    def engine(**kv):
        return LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, **kv))

    prompts = [f"System: answer briefly.\nUser: tell me about pool member {k} please" for k in range(4)]
    want = {}
    with RunningServer(engine()) as plain:
        for p in prompts:
            want[p] = httpx.post(plain.url + "/v1/completions", json=_greedy(p), timeout=HANG_S).json()
    with contextlib.ExitStack() as stack:
        prefills = [stack.enter_context(RunningServer(engine(kv_role="prefill"), kv_role="prefill",
                                                      kv_peer_secret=PEER_SECRET)) for _ in range(2)]
        decodes = [stack.enter_context(RunningServer(engine(kv_role="decode", kv_offload_gib=0.01), kv_role="decode",
                                                     kv_peer_secret=PEER_SECRET)) for _ in range(2)]
        router = RunningRouter([d.url for d in decodes], "cache_aware", prefills=[p.url for p in prefills])
        with router:
            for p in prompts:
                r = httpx.post(router.url + "/v1/completions", json=_greedy(p), timeout=HANG_S)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want[p]["choices"][0]["text"]
            decisions = router.router.decisions
            assert (decisions.prefilled, decisions.prefill_fallbacks) == (4, 0)
        sent = [_metric(httpx.get(p.url + "/metrics").text, "tessera_kv_transfer_out_blocks_total") for p in prefills]
        taken = [_metric(httpx.get(d.url + "/metrics").text, "tessera_kv_transfer_in_blocks_total") for d in decodes]
        assert all(n > 0 for n in sent) and sum(taken) == sum(sent)  # both prefills used, every block taken


def _greedy(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_round_robin_takes_the_replicas_in_turn(replicas):
    with RunningRouter([s.url for s in replicas], "round_robin") as router:
        messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "again"}]
        order = [_where(replicas, lambda: _chat(router.url, messages))[0] for _ in range(6)]
        assert order[:3] == order[3:] and sorted(order[:3]) == [0, 1, 2]


def test_requests_go_to_the_replicas_that_serve_their_model(replicas, llama):
    other = RunningServer(LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, kv_cache_gib=0.001)), name="other")
    with other, RunningRouter([s.url for s in replicas[:2]] + [other.url], "least_loaded") as router:
        _wait(lambda: all(r.models is not None for r in router.router.replicas))  # the first health checks
        listed = [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]]
        assert listed == ["tiny", "other"]
        everyone = [*replicas[:2], other]
        for _ in range(2):
            body = {"model": "other", "prompt": "which", "max_tokens": 2}
            where, _ = _where(everyone, lambda b=body: httpx.post(router.url + "/v1/completions", json=b,
                                                                   timeout=HANG_S))
            assert where == 2
            where, _ = _where(everyone, lambda b=body: httpx.post(router.url + "/v1/completions",
                                                                   json={**b, "model": "tiny"}, timeout=HANG_S))
            assert where in (0, 1)


def test_least_loaded_sends_each_request_where_nothing_is_in_flight():
    with OddReplica("hold") as a, OddReplica("hold") as b, OddReplica("hold") as c, \
            RunningRouter([a.url, b.url, c.url], "least_loaded") as router, ThreadPoolExecutor(4) as pool:
        held = [a, b, c]
        send = lambda: httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"},  # noqa: E731
                                  timeout=HANG_S)
        answers = []
        for n in range(1, 4):
            answers.append(pool.submit(send))
            _wait(lambda n=n: sum(r.held for r in held) == n)
        assert [r.held for r in held] == [1, 1, 1]
        b.release.set()
        _wait(lambda: b.held == 0)
        answers.append(pool.submit(send))  # b has nothing in flight now
        _wait(lambda: b.received == 2)
        a.release.set()
        c.release.set()
        assert [f.result(HANG_S).json() for f in answers] == [ANSWER] * 4


def _metric(page: str, name: str) -> float:
    [value] = [float(line.split()[-1]) for line in page.splitlines() if line.startswith(name + " ")]
    return value


def _wait(condition) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@contextlib.contextmanager
def _odd(kind: str, llama):
    """The URL of a replica that is `kind`, and what to call to make it so: "gone" (a server that
    answers until it is stopped), or an OddReplica mode."""
    if kind != "gone":
        with OddReplica("hold" if kind == "hangs" else kind) as odd:
            yield odd.url, lambda: None
        return
    spare = RunningServer(LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, kv_cache_gib=0.001)))
    with spare:
        yield spare.url, lambda: spare.__exit__(None, None, None)  # stopped: connections refused


@pytest.mark.parametrize("kind", ["gone", "hang_up", "garbage", "hangs"])
def test_a_lost_replica_costs_a_retry(replicas, llama, kind):
    messages = [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "still there?"}]
    want = _chat(replicas[0].url, messages).json()["choices"][0]["message"]["content"]
    with _odd(kind, llama) as (odd, lose), RunningRouter([odd, replicas[0].url], "round_robin", first_byte_s=1.0,
                                                         health_interval_s=HANG_S) as router:
        _wait(lambda: all(r.models is not None for r in router.router.replicas))  # the first health check
        lose()
        r = _chat(router.url, messages)  # the odd replica's turn first
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, r.text
        metrics = httpx.get(router.url + "/metrics").text
        assert _metric(metrics, f'tessera_router_replica_failures_total{{replica="{odd}"}}') == 1
        assert _metric(metrics, 'tessera_router_decisions_total{reason="retry"}') == 1
        assert _metric(metrics, f'tessera_router_replica_healthy{{replica="{odd}"}}') == 0
        streamed = _chat(router.url, messages, stream=True)  # the odd one out of service: no retry now
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == want


def test_a_replica_lost_mid_stream_ends_the_stream_with_an_error(replicas):
    """Committed at its first event, a stream is not answered twice: the client gets what came, an
    error event naming the replica and [DONE]; the replica is out of service and the next request
    goes elsewhere."""
    with OddReplica("breaks_stream") as odd, RunningRouter([odd.url, replicas[0].url], "round_robin",
                                                                   health_interval_s=HANG_S) as router:
        body = {"model": "tiny", "prompt": "stream", "max_tokens": 4, "stream": True}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=HANG_S)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["text"] == "half"
        assert f"replica {odd.url} broke off its answer" in json.loads(events[1])["error"]["message"]
        assert events[2:] == ["[DONE]"]
        again = httpx.post(router.url + "/v1/completions", json={**body, "stream": False}, timeout=HANG_S)
        assert again.status_code == 200 and odd.received == 1


def test_the_prefix_index_is_bounded_and_forgets_a_replica():
    index = PrefixIndex(chunk_chars=4, max_entries=5)
    keys = index.keys("abcdefghijklmnopqrstuvwxyz")  # 6 whole chunks, the rest none
    assert len(keys) == 6
    index.record(keys[:3], "A", 0)
    assert index.match(index.keys("abcdefghijkl-other")) == {"A": 3}
    index.record(keys, "B", 3)
    assert len(index.holders) == 5  # the least recently used key dropped
    assert index.match(keys) == {}  # its first chunk's key went first: no prefix is known any more
    index.record(keys, "B", 0)
    index.forget("B")
    assert index.match(keys) == {} and all(h == ["A"] for h in index.holders.values())


@pytest.mark.parametrize("argv, message", [
    ([], "needs --replica URL (repeatable), or --prefill URL and --decode URL"),
    (["--replica", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:8"], "are exclusive"),
    (["--replica", "ftp://x"], "--replica 'ftp://x' is invalid"),
])
def test_bad_router_options_exit_2(argv, message, capsys):
    assert tessera_main(["router", *argv, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_the_responses_and_messages_apis_report_their_hits_to_the_router(replicas):
    """The router reads a replica's prefix-cache hits in every API's usage: the Responses API's
    `input_tokens_details.cached_tokens` and the Messages API's `cache_read_input_tokens`, whole and
    at the end of a stream (tessera/infer/fleet/prefix_index.py's `reported_hit`)."""
    replica = replicas[0]
    system = "You are the assistant of the router's hit counting test, which repeats its long system prompt."
    name = f'tessera_router_replica_cached_tokens_total{{replica="{replica.url}"}}'
    requests = [("/v1/responses", {"instructions": system, "input": "hello", "max_output_tokens": 2},
                 lambda j: j["usage"]["input_tokens_details"]["cached_tokens"]),
                ("/v1/messages", {"system": system, "messages": [{"role": "user", "content": "hello"}],
                                  "max_tokens": 2}, lambda j: j["usage"]["cache_read_input_tokens"])]
    with RunningRouter([replica.url], "cache_aware") as router:
        counted = lambda: _metric(httpx.get(router.url + "/metrics").text, name)  # noqa: E731
        for path, body, hit in requests:
            for _ in range(2):  # the second finds the first's prompt cached
                before = counted()
                r = httpx.post(router.url + path, json={"model": "tiny", "temperature": 0, **body}, timeout=HANG_S)
                assert r.status_code == 200, r.text
                assert counted() - before == hit(r.json())
            assert hit(r.json()) > 0
        before = counted()
        body = {"model": "tiny", "temperature": 0, "stream": True, **requests[1][1]}
        with httpx.stream("POST", router.url + "/v1/messages", json=body, timeout=HANG_S) as stream:
            data = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
        [end] = [e for e in data if e["type"] == "message_delta"]
        assert end["usage"]["cache_read_input_tokens"] > 0
        _wait(lambda: counted() - before == end["usage"]["cache_read_input_tokens"])


def test_a_streamed_responses_answer_whose_last_event_is_long_reports_its_hit(replicas):
    """A streamed Responses answer ends with one event repeating the whole response (here its long
    `metadata`, past the 4 KiB the router once kept of a stream's tail): the router still reads that
    event's cached tokens (tessera/infer/fleet/prefix_index.py's `StreamUsage`)."""
    replica = replicas[1]
    name = f'tessera_router_replica_cached_tokens_total{{replica="{replica.url}"}}'
    body = {"model": "tiny", "temperature": 0, "stream": True, "max_output_tokens": 2, "input": "hello",
            "metadata": {"note": "m" * 6000},
            "instructions": "You are the assistant of the long last event test, with a prompt long enough to cache."}
    with RunningRouter([replica.url], "cache_aware") as router:
        counted = lambda: _metric(httpx.get(router.url + "/metrics").text, name)  # noqa: E731
        for _ in range(2):  # the second finds the first's prompt cached
            before = counted()
            with httpx.stream("POST", router.url + "/v1/responses", json=body, timeout=HANG_S) as stream:
                assert stream.status_code == 200, stream.read()
                lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
            last = json.loads(lines[-1][6:])
            assert last["type"] == "response.incomplete" and len(lines[-1]) > 4096  # max_output_tokens reached
            cached = last["response"]["usage"]["input_tokens_details"]["cached_tokens"]
            _wait(lambda: counted() - before == cached)  # noqa: B023
        assert cached > 0
