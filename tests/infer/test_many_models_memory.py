"""What a sleeping model gives back, seen from outside: the resident memory (VmRSS of
/proc/PID/status) of a `tessera serve --model ... --sleep-level 2` process drops by most of a model's
weights when that model is evicted to make room for another and when it is put to sleep by
`POST /sleep?level=2`, and grows by them when it wakes. A model of about 90 MiB of fp32 weights
(and a third of it as the other model) makes the change stand well above the process's other
memory; the KV caches are kept small beside it. Put to sleep, the process gives back at least what
the server counted the model as holding (/metrics; the freed pages of its loading come back too:
about twice that here); evicted, half of it, the other model taking some of its place; woken, it
grows by half of it again. Put to sleep at level 1, a model of small weights and a KV cache of
about 300 MiB in 16 stores of 19 MiB (below glibc's 32 MiB mmap threshold, so the heap holds them,
and `tessera serve` tells the allocator to keep freed heap pages) gives back more than half of its
KV cache and takes it again on waking. Nothing here is timed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.hang_guard import HANG_S
from tests.infer.running_server import serving_url, stop_serving, terminate_if_running
from tests.infer.tiny_models import write_model

MIB = 2**20


def _rss(pid: int) -> int:
    """Bytes process `pid` holds in memory (its VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def _resident(url: str, model: str) -> int:
    """Bytes the server counts `model` as holding (/metrics)."""
    prefix = f'tessera_model_resident_bytes{{model="{model}"}} '
    [line] = [x for x in httpx.get(url + "/metrics", timeout=HANG_S).text.splitlines() if x.startswith(prefix)]
    return int(float(line[len(prefix):]))


def _complete(url: str, model: str) -> None:
    body = {"model": model, "prompt": "resident", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text


def _write(path: Path, layers: int) -> Path:
    write_model(path, "llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=4)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A model of six layers and one of two (the budget holds one of them, not both)."""
    return _write(tmp_path_factory.mktemp("big"), 6), _write(tmp_path_factory.mktemp("small"), 2)


@pytest.mark.slow
def test_an_evicted_or_sleeping_model_gives_its_memory_back(models):
    big, small = models
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--model", f"big={big}", "--model",
                             f"small={small}", "--memory-budget-gib", "0.14", "--sleep-level", "2",
                             "--keep-alive", "0", "--port", "0", "--block-size", "4", "--kv-cache-gib", "0.001",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    try:
        url = serving_url(proc)
        _complete(url, "big")  # awake; the budget (room for one) put the small model to sleep
        weights = sum(f.stat().st_size for f in big.glob("*.safetensors"))
        held = _resident(url, "big")  # its weights as served and its KV cache
        assert held >= weights > 80 * MIB and _resident(url, "small") == 0
        for put_down in ("evicted", "asked"):
            awake = _rss(proc.pid)
            if put_down == "evicted":
                _complete(url, "small")  # the big model makes room
            else:
                r = httpx.post(url + "/sleep", params={"model": "big", "level": 2}, timeout=HANG_S)
                assert r.json()["level"] == 2, r.text
            assert _resident(url, "big") == 0
            asleep = _rss(proc.pid)
            # all it held (loading leaves more); evicted, half: the small model took some of its place
            enough = held if put_down == "asked" else held / 2
            assert awake - asleep > enough, (put_down, awake / MIB, asleep / MIB, held / MIB)
            _complete(url, "big")  # woken: its weights are read again
            assert _rss(proc.pid) - asleep > held / 2
        stop_serving(proc)
    finally:
        terminate_if_running(proc)


@pytest.mark.slow
def test_a_model_asleep_at_level_1_gives_its_kv_cache_back(tmp_path):
    path = tmp_path / "m"
    write_model(path, "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=4)
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--model", f"m={path}",
                             "--memory-budget-gib", "2", "--sleep-level", "1", "--keep-alive", "0", "--port", "0",
                             "--kv-cache-gib", "0.3", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    try:
        url = serving_url(proc)
        _complete(url, "m")  # loaded and awake
        held, awake = _resident(url, "m"), _rss(proc.pid)
        r = httpx.post(url + "/sleep", params={"model": "m", "level": 1}, timeout=HANG_S)
        assert r.json()["level"] == 1, r.text
        kv = held - _resident(url, "m")  # level 1 on the CPU: the weights are still counted, the KV cache not
        assert kv > 200 * MIB, kv / MIB
        asleep = _rss(proc.pid)
        assert awake - asleep > kv / 2, (awake / MIB, asleep / MIB, kv / MIB)
        _complete(url, "m")  # woken: its KV cache allocated (and zeroed) again
        assert _rss(proc.pid) - asleep > kv / 2, (asleep / MIB, kv / MIB)
        stop_serving(proc)
    finally:
        terminate_if_running(proc)
