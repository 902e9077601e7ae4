"""`tessera serve` as a process: the contract, /health, greedy /v1/completions under the one model
name /v1/models lists (the directory as given, or --served-model-name; no other spelling)."""

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.hang_guard import HANG_S
from tests.infer.running_server import (
    free_port,
    serve_main,
    serving_url,
    stop_serving,
    terminate_if_running,
    wait_until_serving,
)
from tests.infer.tiny_models import hf_greedy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_serve_command_answers_the_contract(llama):
    path, hf = llama
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(path), "--port", str(port),
                             "--block-size", "4", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1",
                                                                                   "PATH": "/usr/bin:/bin"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url)
        [model] = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert model == str(path)  # the directory as given
        body = {"model": model, "prompt": "contract", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        from tessera.data.tokenizer import Tokenizer
        tok = Tokenizer.from_path(path)
        assert tok.encode(text, add_special_tokens=False) == hf_greedy(hf, tok.encode("contract"), 8)
        other = httpx.post(url + "/v1/completions", json={**body, "model": path.name}, timeout=HANG_S)
        assert other.status_code == 404 and model in other.json()["error"]["message"]
        # bound to 127.0.0.1 without --allowed-hosts: a foreign Host name (DNS rebinding) is refused
        assert httpx.get(url + "/v1/models", headers={"Host": "evil.example"}).status_code == 400
        assert httpx.get(url + "/v1/models", headers={"Host": f"localhost:{port}"}).status_code == 200
        stop_serving(proc)  # Ctrl-C: a clean stop
    finally:
        terminate_if_running(proc)


@pytest.mark.slow
def test_requests_use_exactly_the_name_v1_models_lists(llama):
    """Served as --served-model-name, from a directory given relatively: that name is the one
    /v1/models lists and the one requests answer to; the directory as given, its absolute path and
    its base name get a 404 naming the served model."""
    path, _ = llama
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", path.name, "--port", "0",
                             "--served-model-name", "tiny-served", "--block-size", "4", "--log-level", "warning"],
                            cwd=path.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = serving_url(proc)
        wait_until_serving(proc, url)
        models = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert models == ["tiny-served"]
        body = {"model": models[0], "prompt": "name", "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200 and r.json()["model"] == "tiny-served", r.text
        for other in (path.name, str(path), str(path.resolve())):
            r = httpx.post(url + "/v1/completions", json={**body, "model": other}, timeout=HANG_S)
            assert r.status_code == 404, (other, r.text)
            assert "does not exist" in r.json()["error"]["message"] and "tiny-served" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(HANG_S)


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, capsys):
    """Said at once with exit status 2, not after loading: the directory does not even exist."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert serve_main([str(tmp_path / "no-such-model"), "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port} cannot be listened on" in err and "in use" in err, err
    assert serve_main([str(tmp_path / "no-such-model"), "--port", str(port), "--device", "cpu"]) == 1  # now free
    assert "no-such-model" in capsys.readouterr().err


def test_the_port_is_listened_on_before_the_model_loads():
    """Bound and listening (a socket only bound could still be taken by another SO_REUSEADDR
    server, such as a second `tessera serve`), one socket per address the host resolves to."""
    from tessera.cli.listening import listen_sockets as _listen_sockets
    from tessera.config.errors import ConfigError

    first = _listen_sockets("127.0.0.1", 0)
    try:
        port = first[0].getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port {port} cannot be listened on"):
            _listen_sockets("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=HANG_S):  # accepted into the backlog
            pass
    finally:
        for s in first:
            s.close()
    every = _listen_sockets("", 0)  # every interface: IPv4 (and IPv6 where the machine has it), one port
    try:
        assert {s.getsockname()[1] for s in every} == {every[0].getsockname()[1]}
        assert socket.AF_INET in {s.family for s in every}
    finally:
        for s in every:
            s.close()
    with pytest.raises(ConfigError, match="--host no-such-host.invalid --port 0 cannot be listened on"):
        _listen_sockets("no-such-host.invalid", 0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_serve_quantizes_at_load(method, llama):
    """`tessera serve DIR --quantization M`: the server's greedy completion is the one of `LLM` with
    the same quantization in process."""
    from tessera.infer import LLM, SamplingParams

    path, _ = llama
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(path), "--port", "0", "--block-size", "4",
                             "--quantization", method, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = serving_url(proc)
        wait_until_serving(proc, url)
        body = {"model": str(path), "prompt": "quantized", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        want = LLM(path, block_size=4, quantization=method).generate(
            ["quantized"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].text
        assert r.json()["choices"][0]["text"] == want
    finally:
        proc.terminate()
        proc.wait(HANG_S)
