"""Prefill/decode disaggregation end to end: `tessera serve --kv-role prefill`, `tessera serve
--kv-role decode` and `tessera router` as three processes on 127.0.0.1. Answers through the router
equal the model's own greedy text (plain and streamed, completions and chat) and the decode instance
computes only what the prefill instance did not send; a prefill instance that hangs or dies costs a
recompute on the decode side, never a hang or a different answer. The KV routes answer only peers
holding the KV peer secret: an API client (with the API key) cannot plant forged blocks, and the
instances and the router refuse to start without the secret."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tessera.config.errors import ConfigError
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.infer.scheduling.kv_peer import PEER_SECRET_ENV, PEER_SIGNATURE_HEADER, sign_prefill_request
from tests.hang_guard import HANG_S
from tests.infer.kv_messages import PEER_SECRET, forged, nested, signed
from tests.infer.running_server import RunningServer, serving_url, terminate_if_running, wait_until_serving

ROOT = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), PEER_SECRET_ENV: PEER_SECRET.decode()}
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


API_KEY = "the key every API client holds"
GREEDY_BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def peers(llama):
    """(prefill, decode) instances in this process, with the API key and the KV peer secret."""
    def engine(**kv):
        return LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, **kv))

    with RunningServer(engine(kv_role="prefill"), api_key=API_KEY, kv_role="prefill",
                       kv_peer_secret=PEER_SECRET) as prefill, \
            RunningServer(engine(kv_role="decode", kv_offload_gib=0.01), api_key=API_KEY, kv_role="decode",
                          kv_peer_secret=PEER_SECRET) as decode:
        yield prefill, decode


def _client(url: str, path: str, content: bytes, **headers: str) -> httpx.Response:
    return httpx.post(url + path, content=content, timeout=HANG_S,
                      headers={"authorization": f"Bearer {API_KEY}", **headers})


def _prefill_message(prefill) -> bytes:
    """A genuine KV transfer message for PROMPT, asked for as the router asks (signed with the secret)."""
    body = json.dumps({"endpoint": "completions", "request": GREEDY_BODY}).encode()
    r = _client(prefill.url, "/v1/kv/prefill", body, **{PEER_SIGNATURE_HEADER: sign_prefill_request(PEER_SECRET,
                                                                                                      body)})
    assert r.status_code == 200, r.text
    return r.content


def test_an_api_client_cannot_plant_kv_blocks(peers):
    """The attack of issue 55: a client holding the API key takes a genuine prefill message, replaces
    the keys and values, recomputes the checksums and posts it to the decode instance's import route.
    Refused (403) before a block is taken, so a later ordinary request for the same prompt decodes
    from its own blocks; the prefill route answers no unsigned request either. A peer's message is
    still taken."""
    prefill, decode = peers
    message = _prefill_message(prefill)
    r = _client(decode.url, "/v1/kv/import", forged(message), **{"content-type": "application/octet-stream"})
    assert r.status_code == 403, r.text
    assert "KV peer secret" in r.json()["error"]["message"]
    assert decode.engine.tier_metrics.transfer_in_blocks == 0
    want = httpx.post(prefill.url + "/v1/completions", json=GREEDY_BODY, timeout=HANG_S,
                      headers={"authorization": f"Bearer {API_KEY}"}).json()["choices"][0]["text"]
    r = httpx.post(decode.url + "/v1/completions", json=GREEDY_BODY, timeout=HANG_S,
                   headers={"authorization": f"Bearer {API_KEY}"})
    assert r.json()["choices"][0]["text"] == want
    body = json.dumps({"endpoint": "completions", "request": GREEDY_BODY}).encode()
    for signature in ({}, {PEER_SIGNATURE_HEADER: "00" * 32}):
        r = _client(prefill.url, "/v1/kv/prefill", body, **signature)
        assert r.status_code == 403 and "KV peer secret" in r.json()["error"]["message"]
    r = _client(decode.url, "/v1/kv/import", message)
    assert r.status_code == 200 and r.json()["blocks"] > 0  # the peers' own channel works


def test_a_kv_header_nested_too_deeply_is_a_400(peers):
    _, decode = peers
    r = _client(decode.url, "/v1/kv/import", signed(nested(20_000)))
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    r = _client(decode.url, "/v1/kv/import", signed(nested(20_000), b"not the peers' secret at all"))
    assert r.status_code == 403, r.text
    assert httpx.get(decode.url + "/health", timeout=HANG_S).status_code == 200


@pytest.mark.parametrize("secret, fragment", [
    (None, "--kv-role decode on --host 0.0.0.0 needs a KV peer secret"),
    ("short", "the KV peer secret has 5 bytes, at least 16"),
    (API_KEY, "the KV peer secret must differ from --api-key"),
    ("file:644", "other users may read or change it (mode 644; chmod 600 it)"),
    ("file:fifo", "not a regular file"),
])
def test_kv_roles_start_only_with_a_peer_secret(llama, tmp_path, monkeypatch, capsys, secret, fragment):
    from tessera.cli import main

    monkeypatch.delenv(PEER_SECRET_ENV, raising=False)
    argv = ["serve", str(llama[0]), "--port", "0", "--api-key", API_KEY, "--kv-role", "decode",
            "--kv-offload-gib", "0.01", "--host", "0.0.0.0"]  # beyond loopback: no user's own secret
    if secret is not None and secret.startswith("file:"):
        path = tmp_path / "secret"
        if secret == "file:fifo":
            os.mkfifo(path)
        else:
            path.write_bytes(PEER_SECRET)
            path.chmod(0o644)
        argv += ["--kv-peer-secret-file", str(path)]
    elif secret is not None:
        monkeypatch.setenv(PEER_SECRET_ENV, secret)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_processes_on_loopback_share_their_users_own_secret(tmp_path, monkeypatch):
    """Without a secret given, instances and a router that all listen and call on loopback (the
    README's one-machine example, as it ran before secrets existed) read one made once for their
    user, in a file only that user can read; none is made for a process beyond loopback."""
    from tessera.infer.scheduling.kv_peer import local_secret_file, read_kv_peer_secret

    monkeypatch.delenv(PEER_SECRET_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert read_kv_peer_secret(None, API_KEY, on_loopback=False) is None
    assert not local_secret_file().exists()
    first = read_kv_peer_secret(None, API_KEY, on_loopback=True)
    assert len(first) >= 32 and read_kv_peer_secret(None, API_KEY, on_loopback=True) == first
    assert local_secret_file().stat().st_mode & 0o777 == 0o600
    assert local_secret_file().parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in local_secret_file().parent.iterdir()] == ["kv-peer-secret"]
    local_secret_file().chmod(0o644)  # loosened by hand: refused as a given file would be
    with pytest.raises(ConfigError, match="other users may read or change it"):
        read_kv_peer_secret(None, API_KEY, on_loopback=True)


def test_the_router_starts_only_with_a_peer_secret(monkeypatch, capsys):
    from tessera.cli import main

    monkeypatch.delenv(PEER_SECRET_ENV, raising=False)
    # a backend beyond loopback: the router cannot share its user's own secret with it
    assert main(["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://10.0.0.2:2", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "tessera router needs a KV peer secret" in err and len(err.strip().splitlines()) == 1, err
