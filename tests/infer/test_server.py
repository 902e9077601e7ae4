"""The OpenAI-compatible server, over real HTTP on 127.0.0.1: completions (plain, streamed, chat),
64 concurrent streams, malformed requests, API keys, client disconnects, metrics."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from tessera.infer import EngineConfig, LLMEngine
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer


@pytest.fixture(scope="module")
def server(llama):
    path, _ = llama
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, max_num_seqs=64, max_num_batched_tokens=256))
    with RunningServer(engine, name="tiny") as s:
        yield s


def _events(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_models_and_greedy_completion(server, llama):
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    out = r.json()
    text = out["choices"][0]["text"]
    tok = server.engine.tokenizer
    from tests.infer.tiny_models import hf_greedy
    assert tok.encode(text, add_special_tokens=False) == hf_greedy(llama[1], tok.encode("hello world"), 12)
    assert out["usage"] == {"prompt_tokens": 12, "completion_tokens": 12, "total_tokens": 24,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert out["choices"][0]["finish_reason"] == "length"


def test_chat_completion_uses_the_template(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>")


def test_64_concurrent_streams_finish_well_formed(server):
    async def one(client, i):
        body = {"model": "tiny", "prompt": f"request {i}: " + "x" * (i % 7), "max_tokens": 10 + i % 5,
                "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            return _events([line async for line in r.aiter_lines()]), body

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=HANG_S) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    for i, (events, body) in enumerate(results):
        assert events[-1] == "[DONE]"
        *chunks, use = events[:-1]
        assert use["choices"] == [] and use["usage"]["completion_tokens"] == body["max_tokens"]
        assert all(c["object"] == "text_completion" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        if i % 16 == 0:  # the same seed without streaming, alone: the same text
            text = "".join(c["choices"][0]["text"] for c in chunks)
            alone = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=HANG_S).json()
            assert alone["choices"][0]["text"] == text
    assert server.wait_idle()
    assert server.engine.blocks.num_free_blocks == server.engine.blocks.num_blocks


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"model": "tiny"}).encode(), 400, "'prompt' is required"),
    (json.dumps({"model": "nope", "prompt": "a"}).encode(), 404, "does not exist"),
    (json.dumps({"model": "tiny", "prompt": "a", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": "tiny", "prompt": "a", "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "a", "top_p": 1.5}).encode(), 400, "top_p"),
    (json.dumps({"model": "tiny", "prompt": "a" * 300}).encode(), 400, "maximum context length"),
    (json.dumps({"model": "tiny", "prompt": [1, 2, 999]}).encode(), 400, "token ids"),
    (json.dumps({"model": "tiny", "prompt": "a", "n": 17}).encode(), 400, "'n'"),
    (json.dumps({"model": "tiny", "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": "tiny", "prompt": "a", "presence_penalty": 2.5}).encode(), 400, "presence_penalty"),
    (json.dumps({"model": "tiny", "prompt": "a", "logprobs": 21}).encode(), 400, "'logprobs'"),
])
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server, body, status, fragment):
    route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(server.url + route, content=body, headers={"content-type": "application/json"}, timeout=HANG_S)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                    timeout=HANG_S)
    assert ok.status_code == 200


def test_a_request_the_engine_refuses_gets_a_400_naming_the_field(server):
    """The engine checks a request once (LLMEngine.check_request); its refusal names the API's field."""
    for body, param in (({"prompt": [1] * 300}, "prompt"), ({"prompt": "a", "logit_bias": {"999": 1}}, "logit_bias")):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=HANG_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _hold_engine(server):
    """Block the engine thread between steps until the returned event is set."""
    gate, entered = threading.Event(), threading.Event()

    def wait(_engine):
        entered.set()
        gate.wait(HANG_S)

    server.loop.call(wait)
    assert entered.wait(HANG_S)
    return gate


def _wait_for_inbox(server, n=1, timeout=HANG_S):
    """Wait until the held engine has `n` commands queued."""
    deadline = time.monotonic() + timeout
    while server.loop._inbox.qsize() < n:
        assert time.monotonic() < deadline, "the server never queued the abort"
        time.sleep(0.01)


def test_disconnects_free_their_blocks(server):
    before = server.engine.metrics.requests_finished.get("abort", 0)
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 240, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=HANG_S) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            gate = _hold_engine(server)  # so the request cannot finish before the server sees the hang-up
    _wait_for_inbox(server)
    gate.set()
    gate = _hold_engine(server)
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
    _wait_for_inbox(server, 2)  # the request, then its abort
    gate.set()
    assert server.wait_idle()
    assert server.engine.metrics.requests_finished.get("abort", 0) == before + 2
    assert server.engine.blocks.num_free_blocks == server.engine.blocks.num_blocks
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_page_is_prometheus_text(server):
    httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3}, timeout=HANG_S)
    text = httpx.get(server.url + "/metrics").text
    for name in ("tessera_requests_total", "tessera_generation_tokens_total", "tessera_time_to_first_token_seconds",
                 "tessera_time_per_output_token_seconds", "tessera_prefix_cache_hit_rate",
                 "tessera_spec_acceptance_rate"):
        assert f"# TYPE {name}" in text
    count = [ln for ln in text.splitlines() if ln.startswith("tessera_time_to_first_token_seconds_count")]
    assert int(count[0].split()[-1]) >= 1


def test_api_key_is_required_when_set(llama):
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=128))
    with RunningServer(engine, name="tiny", api_key="sekrit") as s:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(s.url + "/v1/completions", json=body, headers=wrong).status_code == 401
        r = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"}, timeout=HANG_S)
        assert r.status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
