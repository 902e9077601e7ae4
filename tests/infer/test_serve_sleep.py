"""vLLM's sleep routes on the one-model server (tessera/infer/api/sleep_routes.py), over real HTTP on
127.0.0.1: level 1 frees the KV cache, a request arriving asleep wakes the engine and answers as
HuggingFace's greedy generation; /wake_up wakes it; level 2 is refused naming level 1; a sleep under
a running request is a 409; with --api-key the routes need the key."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tessera.data.tokenizer import Tokenizer
from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.api.sleep_routes import EngineSleep
from tessera.infer.config import EngineConfig
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.engine.loop import EngineLoop
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.tiny_models import hf_greedy

KEY = {"Authorization": "Bearer sleepy"}


def _complete(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers=KEY, timeout=HANG_S)


def _kv_bytes(engine: LLMEngine) -> int:
    return sum(s.untyped_storage().nbytes() for s in engine.kv.stores())


def test_sleep_wake_and_a_request_that_wakes_it(llama):
    path, hf = llama
    tok = Tokenizer.from_path(path)
    expected = {p: tok.decode(hf_greedy(hf, tok.encode(p), 6)) for p in ("asleep", "awake")}
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, max_num_seqs=4, kv_cache_gib=0.001))
    with RunningServer(engine, api_key="sleepy") as server:
        url = server.url
        assert httpx.get(url + "/is_sleeping").status_code == 401  # behind the key, as /v1 is
        assert httpx.post(url + "/sleep", params={"level": 1}).status_code == 401
        assert _complete(url, "asleep").json()["choices"][0]["text"] == expected["asleep"]
        held = _kv_bytes(engine)
        assert held > 0
        again = _complete(url, "asleep").json()["usage"]  # its prompt's full blocks found in the prefix cache
        assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] // 4 * 4 > 0

        two = httpx.post(url + "/sleep", params={"level": 2}, headers=KEY, timeout=HANG_S)
        assert two.status_code == 400 and two.json()["error"]["param"] == "level"
        assert "allowed 1" in two.json()["error"]["message"]

        r = httpx.post(url + "/sleep", params={"level": 1}, headers=KEY, timeout=HANG_S)
        assert r.status_code == 200 and r.json() == {"model": "tiny", "is_sleeping": True, "level": 1}, r.text
        assert _kv_bytes(engine) == 0
        assert httpx.get(url + "/is_sleeping", headers=KEY).json()["is_sleeping"] is True

        woken = _complete(url, "asleep")  # woken by the request, served, not refused
        assert woken.status_code == 200 and woken.json()["choices"][0]["text"] == expected["asleep"]
        assert woken.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the cache came back empty
        assert _kv_bytes(engine) == held
        assert httpx.get(url + "/is_sleeping", headers=KEY).json()["is_sleeping"] is False

        httpx.post(url + "/sleep", params={"level": 1}, headers=KEY, timeout=HANG_S)
        up = httpx.post(url + "/wake_up", headers=KEY, timeout=HANG_S)
        assert up.status_code == 200 and up.json()["level"] == 0 and _kv_bytes(engine) == held
        assert _complete(url, "awake").json()["choices"][0]["text"] == expected["awake"]


def test_a_sleep_under_a_running_request_is_a_409(llama):
    """A request counted in flight (as SleepGate counts each POST under /v1 while it runs) keeps the
    engine awake: the sleep is refused with 409 until it leaves."""
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, max_num_seqs=4, kv_cache_gib=0.001))
    loop = EngineLoop(engine).start()
    state = EngineSleep(loop, "tiny")

    async def scenario() -> None:
        await state.enter()
        with pytest.raises(ProtocolError, match="1 request.s. in flight") as refused:
            await state.sleep(1)
        assert refused.value.status == 409 and state.slept is None
        state.leave()
        await state.sleep(1)
        assert state.state() == {"model": "tiny", "is_sleeping": True, "level": 1} and _kv_bytes(engine) == 0

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()
