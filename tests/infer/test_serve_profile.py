"""`tessera serve --profile-dir DIR`: POST /profile/start and /profile/stop on a real server record the
engine's steps (prefill and decode tokens, schedule / forward / update time, the forward split into
attention, MLP, norms, LM head, the rest of the model, sampling and KV copies) and each request's life;
a request the scheduler preempted (a KV cache too small for every request at once) shows the
preemption in its life, then its prefill again (recompute) and its end. `tessera profile DIR` reports
them, its pictures render, and the routes need the API key when the server has one."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser

import httpx
import pytest

from tessera.cli import main
from tessera.infer import SamplingParams
from tessera.infer.config import EngineConfig
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.engine.step_profile import EngineProfile
from tessera.infer.runner import model_runner
from tessera.profiling.serving import FORWARD_PARTS, analyse_serving, read_steps, serving_scene
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer

PROMPTS = [f"prompt number {i} is here" for i in range(6)]


def _complete(url: str, prompt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_preempted_request_shows_its_preemption_and_the_report_renders(llama, tmp_path, capsys):
    directory = tmp_path / "prof"
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=24, max_model_len=64, max_num_seqs=8,
                                                       enable_prefix_caching=False))
    with RunningServer(engine, name="tiny", profile_dir=directory) as server:
        assert httpx.post(server.url + "/profile/start", timeout=HANG_S).json()["recording"] is True
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: _complete(server.url, p), PROMPTS))
        stopped = httpx.post(server.url + "/profile/stop", timeout=HANG_S).json()
        assert stopped["recording"] is False and stopped["steps"] > 0
    assert engine.metrics.preemptions > 0
    assert main(["profile", str(directory), "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"),
                 "--png", str(tmp_path / "r.png")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    requests = report["requests"]
    assert len(requests) == len(PROMPTS) and len(report["steps"]) == stopped["steps"]
    assert sum(r["preemptions"] for r in requests.values()) == engine.metrics.preemptions
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    # a decode step samples one token, and so does the end of each prefill (the first, and one again after
    # each preemption's recomputation)
    assert report["tokens"]["decode"] + len(PROMPTS) + engine.metrics.preemptions == generated
    assert report["tokens"]["prefill"] >= sum(a["usage"]["prompt_tokens"] for a in answers)
    preempted = next(r for r in requests.values() if r["preemptions"])
    phases = [phase for phase, _, _ in preempted["life"]]
    at = phases.index("preempted")
    assert "prefill" in phases[at:] and phases[-1] == "finished" and preempted["finish_reason"] == "length"
    # recomputed after the preemption: its prompt and the tokens it had generated are prefilled again
    assert preempted["prefill_tokens"] > max(a["usage"]["prompt_tokens"] for a in answers)
    assert all(r["queued_s"] is not None and r["queued_s"] >= 0 for r in requests.values())
    assert "preempted:" in capsys.readouterr().out
    parser = HTMLParser()
    parser.feed((tmp_path / "r.html").read_text())
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_profile_routes_need_the_api_key(llama, tmp_path):
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=64))
    with RunningServer(engine, name="tiny", api_key="k" * 16, profile_dir=tmp_path / "p") as server:
        assert httpx.post(server.url + "/profile/start", timeout=HANG_S).status_code == 401
        r = httpx.post(server.url + "/profile/start", headers={"Authorization": "Bearer " + "k" * 16}, timeout=HANG_S)
        assert r.status_code == 200 and r.json()["recording"] is True
        r = httpx.post(server.url + "/profile/stop", headers={"Authorization": "Bearer " + "k" * 16}, timeout=HANG_S)
        assert r.json() == {"recording": False, "session": 1, "steps": 0, "http_requests": 0, "file": "engine.jsonl"}


ATTENTION_DELAY_S = 0.004  # each attention module's extra time in each forward
SAMPLING_DELAY_S = 0.02  # each step's extra time bringing the logits to the host and sampling


def _slowed(fn, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def test_the_forward_splits_into_attention_mlp_sampling_and_the_rest(llama, tmp_path, monkeypatch, capsys):
    """Sleeps planted in every attention module and in the step's sampling show in those parts, the
    parts add up to each step's forward, and the model's hooks and wrappers are gone after each step."""
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=64, max_model_len=64))
    blocks = list(engine.model.layers.values())
    for block in blocks:
        block.attention.forward = _slowed(block.attention.forward, ATTENTION_DELAY_S)
    monkeypatch.setattr(model_runner, "_to_host", _slowed(model_runner._to_host, SAMPLING_DELAY_S))
    engine.profile = EngineProfile(tmp_path / "prof")
    engine.profile.start()
    for prompt in PROMPTS[:2]:
        engine.add_request(engine.tokenizer.encode(prompt), SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in engine.model.modules())
        assert "forward_split" not in vars(engine.executor.runner.paged)
    engine.profile.stop()
    steps = read_steps(tmp_path / "prof")
    layers = len(blocks)
    for s in steps:
        parts = [s[f"{p}_s"] for p in FORWARD_PARTS]
        assert sum(parts) == pytest.approx(s["forward_s"], rel=1e-6, abs=1e-6)
        assert s["attention_s"] >= layers * ATTENTION_DELAY_S  # one forward of every layer a step
        assert s["sampling_s"] >= SAMPLING_DELAY_S
        assert s["mlp_s"] > 0 and s["norm_s"] > 0 and s["lm_head_s"] > 0
    assert main(["profile", str(tmp_path / "prof")]) == 0
    out = capsys.readouterr().out
    assert "attention" in out and "sampling" in out
    report = analyse_serving(tmp_path / "prof")  # the picture draws the forward as its parts
    boxes = serving_scene(report).boxes
    titles = {box.title.split(":")[0].split()[-1] for box in boxes if box.title.startswith("step")}
    assert {"schedule", "update", *FORWARD_PARTS} <= titles and "forward" not in titles
