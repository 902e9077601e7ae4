"""`tessera serve --profile-dir DIR` times each HTTP request in its parts beside the engine's steps
(tessera/infer/api/http_profile.py): on a real server on 127.0.0.1, a delay planted in the request's
JSON decoding shows as its parsing, one planted in building the answer's JSON as its writing; the
parts add up to the request's time; each HTTP request names its engine requests, whose lives in
`tessera profile DIR` lie between the parsing and the writing; the summary prints them."""

from __future__ import annotations

import json

import httpx
import pytest

from tessera.cli import main
from tessera.infer.api import openai_answers, server
from tessera.infer.config import EngineConfig
from tessera.infer.engine.llm_engine import LLMEngine
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.test_serve_profile import _slowed

PARSE_DELAY_S = 0.05  # each request body's JSON decoding
WRITE_DELAY_S = 0.05  # each whole (not streamed) answer's JSON building
PROMPTS = ["the first prompt", "a second prompt here", "and a third"]


def _stream_chat(url: str) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=HANG_S) as r:
        assert r.status_code == 200
        return "".join(r.iter_text())


def test_http_parsing_and_writing_are_timed_beside_the_engine_steps(llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(server, "_parse_json", _slowed(server._parse_json, PARSE_DELAY_S))
    monkeypatch.setattr(openai_answers, "completion_object",
                        _slowed(openai_answers.completion_object, WRITE_DELAY_S))
    directory = tmp_path / "prof"
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=64, max_model_len=64))
    with RunningServer(engine, name="tiny", profile_dir=directory) as running:
        httpx.post(running.url + "/v1/completions", json={"model": "tiny", "prompt": "before", "max_tokens": 2},
                   timeout=HANG_S)  # before the session: not recorded
        assert httpx.post(running.url + "/profile/start", timeout=HANG_S).json()["recording"] is True
        for prompt in PROMPTS:
            r = httpx.post(running.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                                  "temperature": 0, "ignore_eos": True}, timeout=HANG_S)
            assert r.status_code == 200, r.text
        assert "[DONE]" in _stream_chat(running.url)
        refused = httpx.post(running.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1},
                             timeout=HANG_S)
        assert refused.status_code == 400
        stopped = httpx.post(running.url + "/profile/stop", timeout=HANG_S).json()
    assert stopped["http_requests"] == len(PROMPTS) + 2
    assert main(["profile", str(directory), "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    http = report["http"]["by_request"]
    assert report["http"]["requests"] == len(http) == len(PROMPTS) + 2
    for h in http:
        parts = [h[f"{p}_s"] for p in ("read", "parse", "engine", "write")]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(h["t1"] - h["t0"], abs=1e-6)
        assert h["parse_s"] >= PARSE_DELAY_S and 0 < h["send_s"] <= h["t1"] - h["t0"]
    whole, streamed, bad = http[:len(PROMPTS)], http[len(PROMPTS)], http[-1]
    assert all(h["status"] == 200 and h["write_s"] >= WRITE_DELAY_S and h["engine_s"] > 0 for h in whole)
    assert streamed["path"] == "/v1/chat/completions" and streamed["engine_s"] > 0
    assert bad["status"] == 400 and bad["ids"] == [] and bad["engine_s"] == 0
    ids = [rid for h in http for rid in h["ids"]]
    assert sorted(ids) == sorted(report["requests"]) and len(ids) == len(PROMPTS) + 1
    for h in http:
        for rid in h["ids"]:  # its engine requests' lives lie between its parsing and its writing
            life, (parse, write) = report["requests"][rid]["life"], report["requests"][rid]["http"]
            assert parse[0] == "http parse" and write[0] == "http write" and life[-1][0] == "finished"
            assert parse[2] <= life[0][2] and life[-1][1] <= write[1] + 1e-6 and write[2] == h["t1"]
    out = capsys.readouterr().out
    assert f"HTTP, {len(PROMPTS) + 2} requests" in out and "parse" in out and "write" in out
