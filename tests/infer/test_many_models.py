"""Several models behind one server (`tessera serve --model NAME=PATH ...`, tessera/infer/fleet/model_registry.py),
over real HTTP on 127.0.0.1: each answers as HuggingFace's greedy generation of that model alone,
interleaved with the others; a model put to sleep (level 1: KV cache freed; level 2: engine and
weights dropped) wakes on its next request and answers the same; under a budget that holds one
model the awake models' weights and KV caches never exceed it; a model whose files vanish while it
sleeps at level 2 fails its own requests with the reason while the other serves on; a model not
served is a 404 naming the served ones, and a budget smaller than a model is refused at start, by name."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tessera.infer.fleet.model_registry import GIB
from tests.hang_guard import HANG_S
from tests.infer.many_models import ManyModelServer, answer_text, expected_text
from tests.infer.running_server import serve_main, serving_url, stop_serving, terminate_if_running

PROMPTS = ("many models", "one server", "asleep")


def test_two_models_answer_as_each_alone_interleaved(llama, mixtral):
    (lpath, lhf), (mpath, mhf) = llama, mixtral
    expected = {("a", p): expected_text(lpath, lhf, p) for p in PROMPTS}
    expected |= {("b", p): expected_text(mpath, mhf, p) for p in PROMPTS}
    assert expected[("a", PROMPTS[0])] != expected[("b", PROMPTS[0])]  # two different models
    with ManyModelServer({"a": str(lpath), "b": str(mpath)}) as server:
        listed = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["a", "b"]
        assert {m["id"]: m["state"] for m in listed} == {"a": "asleep", "b": "awake"}  # measured one at a time
        jobs = [(name, p) for p in PROMPTS for name in ("a", "b")] * 2
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda job: answer_text(server.complete(*job)), jobs))
        assert answers == [expected[job] for job in jobs]
        missing = server.complete("c", "x")
        assert missing.status_code == 404 and "['a', 'b']" in missing.json()["error"]["message"]
        metrics = httpx.get(server.url + "/metrics").text
        assert 'tessera_model_requests_total{model="a"} 6' in metrics
        assert 'tessera_model_wakes_total{model="a"} 1' in metrics


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_model_wakes_and_answers_the_same(llama, mixtral, level):
    (lpath, lhf), (mpath, _) = llama, mixtral
    with ManyModelServer({"a": str(lpath), "b": str(mpath)}) as server:
        before = answer_text(server.complete("a", PROMPTS[0]))
        assert before == expected_text(lpath, lhf, PROMPTS[0])
        r = httpx.post(server.url + "/sleep", params={"level": level, "model": "a"}, timeout=HANG_S)
        assert r.status_code == 200 and r.json()["level"] == level, r.text
        asleep = httpx.get(server.url + "/is_sleeping", params={"model": "a"}).json()
        assert asleep == {"model": "a", "is_sleeping": True, "level": level}
        a = server.registry.models["a"]
        if level == 1:  # the KV cache holds no memory; the weights stay (CPU)
            assert all(s.untyped_storage().nbytes() == 0 for s in a.loop.engine.kv.stores())
            assert a.resident_bytes() == a.weights
        else:  # no engine, no weights
            assert a.loop is None and a.resident_bytes() == 0
        assert answer_text(server.complete("a", PROMPTS[0])) == before  # woken by the request
        assert answer_text(server.complete("a", PROMPTS[1])) == expected_text(lpath, lhf, PROMPTS[1])
        assert httpx.get(server.url + "/is_sleeping", params={"model": "a"}).json()["is_sleeping"] is False
        several = httpx.get(server.url + "/is_sleeping")
        assert several.status_code == 400 and several.json()["error"]["param"] == "model"
        httpx.post(server.url + "/sleep", params={"level": level, "model": "a"}, timeout=HANG_S)
        assert httpx.post(server.url + "/wake_up", params={"model": "a"}, timeout=HANG_S).json()["level"] == 0


def test_the_budget_is_never_exceeded(llama, mixtral):
    (lpath, lhf), (mpath, mhf) = llama, mixtral
    with ManyModelServer({"a": str(lpath), "b": str(mpath)}) as probe:
        sizes = {m.name: m.weights + m.kv for m in probe.registry.models.values()}
    budget = max(sizes.values()) * 1.5  # room for either model, not both
    assert budget < sum(sizes.values())
    with ManyModelServer({"a": str(lpath), "b": str(mpath)}, budget_gib=budget / GIB) as server:
        registry = server.registry
        for name, path, hf in [("a", lpath, lhf), ("b", mpath, mhf)] * 2:
            assert answer_text(server.complete(name, PROMPTS[2])) == expected_text(path, hf, PROMPTS[2])
            assert registry.resident_total() <= registry.budget
            states = {m["id"]: m["state"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
            assert states == {name: "awake", ({"a", "b"} - {name}).pop(): "asleep"}


def test_two_sleeping_models_woken_at_once_under_a_budget_for_one_both_answer(llama, mixtral):
    """Each wake needs the room the other holds at level 1 (its weights, on the CPU) while the other's
    wake is queued behind it: the first wake puts the queued one deeper (level 2) instead of waiting
    for it, which would wait out --wake-timeout and answer 503."""
    (lpath, lhf), (mpath, mhf) = llama, mixtral
    with ManyModelServer({"a": str(lpath), "b": str(mpath)}) as probe:
        sizes = {m.name: m.weights + m.kv for m in probe.registry.models.values()}
    expected = {"a": [expected_text(lpath, lhf, p) for p in PROMPTS],
                "b": [expected_text(mpath, mhf, p) for p in PROMPTS]}
    with ManyModelServer({"a": str(lpath), "b": str(mpath)}, budget_gib=max(sizes.values()) * 1.01 / GIB,
                         wake_timeout_s=HANG_S / 4) as server:
        for _ in range(2):
            for name in ("a", "b"):  # both asleep, b at level 1 (weights held)
                r = httpx.post(server.url + "/sleep", params={"level": 1, "model": name}, timeout=HANG_S)
                assert r.status_code == 200, r.text
            jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("b", "a")]
            with ThreadPoolExecutor(len(jobs)) as pool:
                answers = list(pool.map(lambda job: server.complete(job[0], PROMPTS[job[1]]), jobs))
            assert [answer_text(r) for r in answers] == [expected[name][i] for name, i in jobs]
            assert server.registry.resident_total() <= server.registry.budget


def test_keep_alive_puts_an_idle_model_to_sleep(llama):
    with ManyModelServer({"a": str(llama[0])}, keep_alive_s=0.2) as server:
        deadline = time.monotonic() + HANG_S
        while not httpx.get(server.url + "/is_sleeping").json()["is_sleeping"]:
            assert time.monotonic() < deadline, "the idle model never went to sleep"
            time.sleep(0.1)
        assert answer_text(server.complete("a", PROMPTS[0])) == expected_text(*llama, PROMPTS[0])


def test_a_model_that_cannot_load_or_wake_fails_alone(llama, mixtral, tmp_path):
    """One model's files never there, another's gone while it sleeps at level 2: each fails its own
    requests with the reason (503), the third serves on."""
    copy = tmp_path / "copy"
    shutil.copytree(llama[0], copy)
    never = tmp_path / "never-there"
    with ManyModelServer({"a": str(copy), "never": str(never), "b": str(mixtral[0])}, sleep_level=2) as server:
        failed = server.complete("never", PROMPTS[0])  # failed to load at start: fails alone, tried again
        assert failed.status_code == 503 and str(never) in failed.json()["error"]["message"], failed.text
        assert answer_text(server.complete("a", PROMPTS[0])) == expected_text(*llama, PROMPTS[0])
        httpx.post(server.url + "/sleep", params={"level": 2, "model": "a"}, timeout=HANG_S)
        shutil.rmtree(copy)
        r = server.complete("a", PROMPTS[0])
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "model 'a' is unavailable" in message and str(copy) in message
        assert answer_text(server.complete("b", PROMPTS[0])) == expected_text(*mixtral, PROMPTS[0])
        listed = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert str(copy) in listed["a"]["error"] and "error" not in listed["b"]


def test_a_budget_smaller_than_a_model_is_refused_by_name(llama, mixtral, capsys):
    status = serve_main(["--model", f"small={llama[0]}", "--model", f"big={mixtral[0]}", "--port", "0",
                         "--memory-budget-gib", "0.0001", "--block-size", "4", "--kv-cache-gib", "0.001"])
    assert status == 2
    err = capsys.readouterr().err
    assert "--memory-budget-gib 0.0001 is smaller than model 'small'" in err


@pytest.mark.parametrize("argv, message", [
    (["--model", "noequals"], "--model 'noequals' is invalid: give NAME=PATH"),
    (["--model", "a=x", "--model", "a=y", "--memory-budget-gib", "1"], "the name 'a' is given twice"),
    (["--model", "a=x"], "--model needs --memory-budget-gib"),
    (["somewhere", "--model", "a=x", "--memory-budget-gib", "1"], "MODEL_DIR 'somewhere' and --model are exclusive"),
    ([], "needs MODEL_DIR, or --model NAME=PATH"),
    (["--model", "a=x", "--model", "b=y", "--memory-budget-gib", "1", "--lora", "x=z"],
     "--lora x=z is invalid with several models: name the model it adapts, --lora MODEL:ADAPTER=DIR"),
    (["--model", "a=x", "--model", "b=y", "--memory-budget-gib", "1", "--lora", "a:b=z"],
     "the adapter's name 'b' must be non-empty and differ from the served models' names"),
    (["--model", "a=x", "--memory-budget-gib", "1", "--kv-role", "decode"], "--kv-role is not supported"),
])
def test_bad_model_options_exit_2(argv, message, capsys):
    assert serve_main([*argv, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_serve_command_serves_several_models(llama, mixtral):
    """`tessera serve --model ... --model ...` as a process: both models answer, one sleeps on
    request, Ctrl-C stops it cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--model", f"a={llama[0]}", "--model",
                             f"b={mixtral[0]}", "--memory-budget-gib", "1", "--keep-alive", "0", "--port", "0",
                             "--block-size", "4", "--kv-cache-gib", "0.001", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    try:
        url = serving_url(proc)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["a", "b"]
        for name, (path, hf) in (("a", llama), ("b", mixtral)):
            body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
            assert answer_text(r) == expected_text(path, hf, PROMPTS[0])
        r = httpx.post(url + "/sleep", params={"model": "b", "level": 2}, timeout=HANG_S)
        assert r.json() == {"model": "b", "is_sleeping": True, "level": 2}
        stop_serving(proc)
    finally:
        terminate_if_running(proc)
