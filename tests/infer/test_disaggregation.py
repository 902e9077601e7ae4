"""Prefill/decode disaggregation end to end: `tessera serve --kv-role prefill`, `tessera serve
--kv-role decode` and `tessera router` as three processes on 127.0.0.1. Answers through the router
equal the model's own greedy text (plain and streamed, completions and chat) and the decode instance
computes only what the prefill instance did not send; a prefill instance that hangs or dies costs a
recompute on the decode side, never a hang or a different answer."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tessera.infer import LLM, SamplingParams
from tests.hang_guard import HANG_S
from tests.infer.running_server import serving_url, terminate_if_running, wait_until_serving

ROOT = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
PROMPT = "System: answer in one short line, politely.\nUser: what is the capital of France?"


def _start(*argv: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tessera", *argv, "--port", "0", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    return proc, serving_url(proc)


def _counter(page: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in page.splitlines() if line.startswith(f"tessera_{name} "))


def _streamed_text(url: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=HANG_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.mark.slow
def test_router_prefill_and_decode_instances(llama):
    path, _ = llama
    engine = ["--block-size", "4", "--decode-batch-sizes", "none"]
    procs = []
    try:
        prefill, prefill_url = _start("serve", str(path), *engine, "--kv-role", "prefill")
        procs.append(prefill)
        decode, decode_url = _start("serve", str(path), *engine, "--kv-role", "decode", "--kv-offload-gib", "0.01")
        procs.append(decode)
        router, url = _start("router", "--prefill", prefill_url, "--decode", decode_url, "--prefill-timeout", "3")
        procs.append(router)
        for proc, u in ((prefill, prefill_url), (decode, decode_url)):
            wait_until_serving(proc, u)
        wait_until_serving(router, url)

        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        llm = LLM(path, block_size=4)
        want = llm.generate([PROMPT], greedy)[0].text
        body = {"model": str(path), "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        full = (len(llm.tokenizer.encode(PROMPT)) - 1) // 4
        page = httpx.get(decode_url + "/metrics", timeout=HANG_S).text
        assert _counter(page, "kv_transfer_in_blocks_total") == full
        assert _counter(page, "kv_host_hit_blocks_total") == full
        sent = httpx.get(prefill_url + "/metrics", timeout=HANG_S).text
        assert _counter(sent, "kv_transfer_out_blocks_total") == full

        other = {**body, "prompt": PROMPT.replace("France", "Spain")}
        want_other = llm.generate([other["prompt"]], greedy)[0].text
        assert _streamed_text(url, other) == want_other
        chat = {"model": str(path), "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}
        direct = httpx.post(decode_url + "/v1/chat/completions", json=chat, timeout=HANG_S).json()
        routed = httpx.post(url + "/v1/chat/completions", json=chat, timeout=HANG_S)
        assert routed.status_code == 200
        assert routed.json()["choices"][0]["message"] == direct["choices"][0]["message"]
        bad = httpx.post(url + "/v1/completions", content=b"{not json", timeout=HANG_S)
        assert bad.status_code == 400  # the decode instance's own answer

        prefill.send_signal(signal.SIGSTOP)  # hangs: the router waits --prefill-timeout, then decode computes
        late = {**body, "prompt": PROMPT.replace("France", "Italy")}
        r = httpx.post(url + "/v1/completions", json=late, timeout=HANG_S)
        assert r.json()["choices"][0]["text"] == llm.generate([late["prompt"]], greedy)[0].text
        prefill.kill()  # dies: the same
        prefill.wait(HANG_S)
        gone = {**body, "prompt": PROMPT.replace("France", "Peru")}
        r = httpx.post(url + "/v1/completions", json=gone, timeout=HANG_S)
        assert r.json()["choices"][0]["text"] == llm.generate([gone["prompt"]], greedy)[0].text
        counters = httpx.get(url + "/metrics", timeout=HANG_S).text
        assert _counter(counters, "router_prefill_fallbacks_total") >= 3  # bad JSON, hung, dead
        assert _counter(counters, "router_prefilled_total") >= 3
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
            terminate_if_running(proc)


def test_a_kv_role_beyond_loopback_needs_a_key(llama, capsys):
    from tessera.cli import main

    path, _ = llama
    status = main(["serve", str(path), "--host", "0.0.0.0", "--port", "0", "--kv-role", "decode",
                   "--kv-offload-gib", "0.01"])
    assert status == 2
    assert "--kv-role decode on --host 0.0.0.0 (beyond this machine) needs --api-key" in capsys.readouterr().err
    assert main(["router", "--prefill", "ftp://x", "--decode", "http://127.0.0.1:1", "--port", "0"]) == 2
    assert "--prefill 'ftp://x' is invalid" in capsys.readouterr().err
