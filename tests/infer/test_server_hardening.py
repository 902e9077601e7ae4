"""The server under hostile input, over real HTTP on 127.0.0.1: malformed and deeply nested
bodies, values that would make sampling produce inf/NaN, oversized bodies (413 while /health keeps
answering), the API key (never empty, also on /metrics) and the Host allow-list; and one request
whose numbers go wrong failing alone while the rest of its batch completes correctly."""

import json
import socket
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.config.errors import ConfigError
from tessera.infer import EngineConfig, LLMEngine, SamplingParams
from tessera.infer.api.http_guards import allowed_hosts, host_name
from tessera.infer.api.server import create_app
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.scheduling.prefix_cache import hash_chain
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer, serve_main
from tests.infer.test_server import _hold_engine
from tests.infer.tiny_models import hf_greedy

MIB = 2**20


@pytest.fixture(scope="module")
def server(llama):
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=256, max_num_seqs=16))
    with RunningServer(engine, name="tiny", allowed_hosts=allowed_hosts(None, "127.0.0.1")) as s:
        yield s


def _post(server, body: bytes, route="/v1/completions", **kw):
    return httpx.post(server.url + route, content=body, headers={"content-type": "application/json"}, timeout=HANG_S,
                      **kw)


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("body, fragment", [
    (DEEP, "nested too deeply"),
    (b'{"model": "tiny", "prompt": "a", "user": ' + DEEP + b"}", "nested too deeply"),
    (b'{"model": ["tiny"], "prompt": "a"}', "'model' must be a string"),
    (b'{"model": {"a": 1}, "prompt": "a"}', "'model' must be a string"),
    (b'{"model": 7, "prompt": "a"}', "'model' must be a string"),
    (b'{"model": ' + b"[" * 500 + b"]" * 500 + b', "prompt": "a"}', "'model' must be a string"),
    (b'{"model": "tiny", "prompt": "a", "temperature": 1e-300}', "temperature"),
    (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "prompt": "a", "temperature": Infinity}', "temperature"),
    (b'{"model": "tiny", "prompt": "a", "top_p": NaN}', "top_p"),
    (b'{"model": "tiny", "prompt": "a", "top_p": -Infinity}', "top_p"),
    (b'{"model": "tiny", "prompt": "a", "logit_bias": {"5": 1e308}}', "logit_bias"),
    (b'{"model": "tiny", "prompt": "a", "stream": "yes"}', "stream"),
    (b'{"model": "tiny", "prompt": "a", "seed": 1e400}', "seed"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 1e9}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "top_k": [1]}', "top_k"),
    (b'{"model": "tiny", "prompt": {"text": "a"}}', "prompt"),
    (b'{"model": "tiny", "messages": [{"role": 1, "content": "x"}]}', "role"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": {"x": 1}}]}', "content"),
    (b'\xff\xfe{"model": "tiny"}', "not valid JSON"),
    (b"", "not valid JSON"),
    # a lone surrogate: JSON may escape it, but it is no Unicode character (the tokenizer would fail on it)
    (b'{"model": "tiny", "prompt": "abc \\ud800"}', "request body: $.prompt is not valid Unicode text"),
    (b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "$.prompt[1] is not valid Unicode text"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udc80"}]}', "$.messages[0].content"),
    (b'{"model": "tiny", "prompt": "a", "stop": ["\\ud83d"]}', "$.stop[0] is not valid Unicode text"),
])
def test_malformed_bodies_get_400_naming_the_problem(server, body, fragment):
    route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = _post(server, body, route)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    ok = _post(server, json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2}).encode())
    assert ok.status_code == 200


def test_errors_do_not_quote_huge_values_back(server):
    stop = ["x" * 1000] * 200
    r = _post(server, json.dumps({"model": "tiny", "prompt": "a", "stop": stop}).encode())
    assert r.status_code == 400 and "stop" in r.json()["error"]["message"]
    r2 = _post(server, json.dumps({"model": "y" * 100_000, "prompt": "a"}).encode())
    assert r2.status_code == 404
    assert len(r.content) < 1000 and len(r2.content) < 1000


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_gets_413_while_health_answers(server, chunked):
    """A 50 MB body is refused with 413, and while it is half sent (its connection open, the rest of
    the body still to come) /health answers another client: a large upload holds up nothing else."""
    chunk = b"x" * MIB
    header = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {50 * MIB}"

    def body_part() -> bytes:
        return f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk

    with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{header}\r\n"
                     "Content-Type: application/json\r\n\r\n".encode() + body_part())
        for _ in range(3):  # the upload is in flight: another client is answered meanwhile
            assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
        try:
            for _ in range(49):
                sock.sendall(body_part())
        except OSError:  # the server answered and closed: the rest of the body is not wanted
            pass
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"--max-request-bytes" in head
    r = _post(server, json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2}).encode())
    assert r.status_code == 200


def test_bodies_under_the_limit_pass_and_over_it_get_413(llama):
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=128))
    with RunningServer(engine, name="tiny", max_request_bytes=200) as s:
        small = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        assert httpx.post(s.url + "/v1/completions", json=small, timeout=HANG_S).status_code == 200
        big = {**small, "prompt": "a" * 300}
        r = httpx.post(s.url + "/v1/completions", json=big, timeout=HANG_S)
        assert r.status_code == 413 and "200 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            yield json.dumps(big).encode()

        assert httpx.post(s.url + "/v1/completions", content=chunks(), timeout=HANG_S).status_code == 413


class GatedTokenizer:
    """The model's real tokenizer, except that `encode` waits for `gate` once it has started:
    a request caught mid-tokenisation for as long as the test wants."""

    def __init__(self, tokenizer):
        self._tokenizer, self.entered, self.gate = tokenizer, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(HANG_S)
        return self._tokenizer.encode(*args, **kwargs)


def test_tokenising_does_not_stall_the_event_loop(llama):
    """While one request is inside the tokenizer, /health and /v1/models still answer: the event
    loop is not the thread doing the tokenising. (Run on the loop, the held tokenizer would
    stall every route until the gate opens.) A 6 MB prompt is refused from its length in
    characters, before any tokenising."""
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=128))
    engine.tokenizer = tok = GatedTokenizer(engine.tokenizer)
    with RunningServer(engine, name="tiny") as s:
        result = {}
        body = {"model": "tiny", "prompt": "held in the tokenizer", "max_tokens": 3, "temperature": 0}
        sender = threading.Thread(target=lambda: result.setdefault("r", httpx.post(s.url + "/v1/completions",
                                                                                  json=body, timeout=HANG_S)))
        sender.start()
        assert tok.entered.wait(HANG_S)
        try:
            for _ in range(3):
                assert httpx.get(s.url + "/health", timeout=HANG_S).status_code == 200
            assert httpx.get(s.url + "/v1/models", timeout=HANG_S).json()["data"][0]["id"] == "tiny"
            assert sender.is_alive()  # still held: the answers above came while it was tokenising
        finally:
            tok.gate.set()
            sender.join(60)
        assert result["r"].status_code == 200, result["r"].text
        t = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "ab " * (2 * MIB)}, timeout=HANG_S)
        assert r.status_code == 400 and "characters cannot fit" in r.json()["error"]["message"]
        assert time.monotonic() - t < 10


def test_unknown_host_headers_are_refused(server):
    with httpx.Client(timeout=HANG_S) as client:
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
            r = client.get(server.url + "/v1/models", headers={"Host": host})
            assert r.status_code == 400 and "Host" in r.json()["error"]["message"], host
        for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:80"):
            r = client.get(server.url + "/v1/models", headers={"Host": host})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", host


def test_allowed_hosts_defaults():
    assert allowed_hosts(None, "127.0.0.1") >= {"localhost", "127.0.0.1", "::1"}
    assert "evil.example" not in allowed_hosts(None, "localhost")
    assert allowed_hosts(None, "0.0.0.0") is None  # the public names are not known: set --allowed-hosts
    assert allowed_hosts("*", "127.0.0.1") is None
    assert allowed_hosts("api.example.com, localhost", "0.0.0.0") == {"api.example.com", "localhost"}
    with pytest.raises(ConfigError, match="allowed-hosts"):
        allowed_hosts(" , ", "127.0.0.1")
    assert host_name(b"Example.COM:8000") == "example.com" and host_name(b"[::1]:8000") == "::1"


def test_api_key_guards_metrics_and_may_not_be_empty(llama):
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=128))
    with pytest.raises(ConfigError, match="empty"):
        create_app(EngineLoop(engine), "tiny", api_key="")
    with RunningServer(engine, name="tiny", api_key="sekrit") as s:
        assert httpx.get(s.url + "/metrics").status_code == 401
        r = httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and "tessera_requests_total" in r.text
        assert httpx.get(s.url + "/health").status_code == 200
        models = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).json()
        assert models["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("argv, fragment", [
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
    (["--max-request-bytes", "0"], "--max-request-bytes"),
    (["--allow-runtime-lora"], "--lora-modules-dir"),
    (["--allowed-hosts", ","], "--allowed-hosts"),
])
def test_serve_refuses_bad_options_in_one_line(argv, fragment, capsys, tmp_path):
    assert serve_main([str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera serve: error: ") and fragment in err and "\n" not in err


def test_serve_refuses_an_empty_key_from_the_environment(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TESSERA_API_KEY", "")
    assert serve_main([str(tmp_path)]) == 2
    assert "TESSERA_API_KEY" in capsys.readouterr().err


def overflowing_adapter(model_dir, out_dir):
    """A PEFT adapter whose lora_B is so large that every logit it touches is inf/NaN."""
    from tests.infer.test_lora import make_adapter

    make_adapter(model_dir, "llama", out_dir, seed=5)
    tensors = load_file(str(out_dir / "adapter_model.safetensors"))
    save_file({k: v * 1e30 if "lora_B" in k else v for k, v in tensors.items()},
              str(out_dir / "adapter_model.safetensors"))


@pytest.mark.parametrize("hostile_temperature", [0.0, 0.8])
def test_a_request_whose_logits_go_nonfinite_fails_alone(llama, tmp_path, hostile_temperature):
    """Six normal requests run concurrently with one whose adapter overflows to inf/NaN logits:
    it alone fails; the six give exactly the tokens they give alone (HF greedy / the same seed),
    the KV cache holds no inf/NaN afterwards, the failed prompt's blocks are out of the prefix
    cache, and later requests are still right."""
    pytest.importorskip("peft")
    path, hf = llama
    overflowing_adapter(path, tmp_path / "boom")
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, num_blocks=256, max_num_seqs=16,
                                                   max_num_batched_tokens=8,  # prefill in chunks
                                                   lora_adapters={"boom": str(tmp_path / "boom")}))
    tok = engine.tokenizer
    prompts = [f"normal request {i}" for i in range(6)]
    sampled = {"temperature": 0.7, "seed": 11}
    with RunningServer(engine, name="tiny") as s:
        def body(i):
            extra = {"temperature": 0} if i % 2 == 0 else sampled
            return {"model": "tiny", "prompt": prompts[i], "max_tokens": 12, "ignore_eos": True, **extra}

        alone_sampled = httpx.post(s.url + "/v1/completions", json=body(1), timeout=HANG_S).json()["choices"][0]["text"]
        hostile = {"model": "boom", "prompt": "hostile " * 3, "max_tokens": 12, "ignore_eos": True,
                   "temperature": hostile_temperature}
        results: dict = {}

        def send(key, b):
            results[key] = httpx.post(s.url + "/v1/completions", json=b, timeout=HANG_S)

        threads = [threading.Thread(target=send, args=("hostile", hostile))]
        threads += [threading.Thread(target=send, args=(i, body(i))) for i in range(6)]
        gate = _hold_engine(s)  # all seven queued before the engine runs again: one batch
        for t in threads:
            t.start()
        deadline = time.monotonic() + HANG_S
        while s.loop._inbox.qsize() < 7:
            assert time.monotonic() < deadline, "the requests never reached the engine"
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join()
        assert results["hostile"].status_code == 500 and "numerical error" in results["hostile"].text
        assert results["hostile"].json()["error"]["type"] == "server_error"
        for i in range(6):
            assert results[i].status_code == 200, results[i].text
            text = results[i].json()["choices"][0]["text"]
            if i % 2 == 0:
                assert tok.encode(text, add_special_tokens=False) == hf_greedy(hf, tok.encode(prompts[i]), 12)
            elif i == 1:
                assert text == alone_sampled
        assert s.wait_idle()
        assert all(torch.isfinite(t).all() for t in (*engine.kv.k, *engine.kv.v))
        # its earlier chunks were named in the prefix cache; zeroed, they must never be found again
        hostile_blocks = hash_chain(tok.encode("hostile " * 3), 4, engine.lora.adapters["boom"].key)
        assert len(hostile_blocks) == 6 and engine.blocks.cache.lookup(hostile_blocks) == []
        again = httpx.post(s.url + "/v1/completions", json=body(0), timeout=HANG_S).json()["choices"][0]["text"]
        assert tok.encode(again, add_special_tokens=False) == hf_greedy(hf, tok.encode(prompts[0]), 12)
    assert engine.metrics.requests_finished.get("error", 0) == 1


def test_blocks_a_failed_request_leaves_are_zeroed_even_when_the_step_then_raises(llama, tmp_path, monkeypatch):
    """The step applies its results request by request: one fails alone on inf/NaN logits (its
    blocks go back to the pool), then applying the next one raises. The first one's blocks are
    zeroed all the same, before any later step could hand them out."""
    pytest.importorskip("peft")
    path, _ = llama
    overflowing_adapter(path, tmp_path / "boom")
    # fcfs (the default, named: the test needs it): the hostile request, the longer prompt, is applied first
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4,
                                                   lora_adapters={"boom": str(tmp_path / "boom")},
                                                   scheduling_policy="fcfs"))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    hostile = engine.add_request(engine.tokenizer.encode("hostile " * 3), greedy, adapter="boom")
    normal = engine.add_request(engine.tokenizer.encode("a normal request"), greedy)
    append = engine.scheduler.outputs.append

    def broken(seq, tokens):
        if seq.request_id == normal:
            raise RuntimeError("applying this request's tokens failed")
        return append(seq, tokens)

    monkeypatch.setattr(engine.scheduler.outputs, "append", broken)
    with pytest.raises(RuntimeError, match="applying this request's tokens failed"):
        engine.step()
    assert engine.metrics.requests_finished.get("error", 0) == 1 and hostile not in engine.scheduler.requests
    assert all(torch.isfinite(t).all() for t in (*engine.kv.k, *engine.kv.v))


def test_tiny_temperatures_are_refused_by_sampling_params():
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=1e-300)
    assert SamplingParams(temperature=1e-5).temperature == 1e-5 and SamplingParams(temperature=0).greedy


def test_a_failed_forward_pass_fails_the_running_requests_not_the_queued_ones(llama):
    """The batch's forward pass raises once (a forward hook on the model that throws on its first
    call): the request it was running fails with an error; the one still queued behind it
    (max_num_seqs=1) runs afterwards and gives the right tokens."""
    path, hf = llama
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=1))
    calls = []

    def throw_once(_module, _inputs, output):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return output

    handle = engine.model.register_forward_hook(throw_once)
    loop = EngineLoop(engine)
    outs: dict = {}
    done = threading.Event()

    def callback(out):
        if out.finished:
            outs[out.request_id] = out
            if len(outs) == 2:
                done.set()

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = engine.tokenizer.encode("queued behind")
    first = loop.submit(engine.tokenizer.encode("first"), greedy, None, callback)
    second = loop.submit(ids, greedy, None, callback)
    loop.start()
    try:
        assert done.wait(HANG_S)
    finally:
        loop.stop()
        handle.remove()
    assert outs[first].finish_reason == "error" and "device lost" in outs[first].error
    assert outs[second].finish_reason == "length" and outs[second].token_ids == hf_greedy(hf, ids, 6)
    assert loop.step_errors == 1


def test_serve_refuses_an_unreadable_model_directory_with_exit_1(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert serve_main([str(tmp_path)]) == 1  # a bad file, not a bad option
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera serve: error: ") and "\n" not in err


@pytest.mark.parametrize("where, value", [("generation_config.json", 10**6), ("config.json", [2, -1])])
def test_an_end_of_sequence_id_outside_the_vocabulary_is_refused_naming_the_file(llama, tmp_path, capsys,
                                                                                 where, value):
    """A stop rule that could never fire would let every request run to max_tokens unnoticed."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama[0], model)
    config = json.loads((model / where).read_text())
    (model / where).write_text(json.dumps({**config, "eos_token_id": value}))
    assert serve_main([str(model), "--device", "cpu", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera serve: error: ") and "\n" not in err, err
    assert f"{where}': eos_token_id={value!r} is invalid" in err and "vocabulary (0..127)" in err


def test_a_system_prompt_longer_than_the_context_is_refused_not_cut(llama):
    with pytest.raises(ConfigError, match=r"system prompt 2 is \d+ tokens; with max_model_len=32 it may be at most 31"):
        LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=64, max_model_len=32,
                                                  system_prompts=["short", "word " * 200]))
