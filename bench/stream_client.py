"""The streaming OpenAI client the serving benchmarks share (bench/serve.py, bench/serve_vs_vllm.py).

It imports neither torch nor Tessera, so a benchmark can use it before it knows whether it will run.
"""

from __future__ import annotations

import json
import socket
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 300) -> None:
    """Wait for a server started by a bench to answer `url`/health."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of `values`; None for none."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, -(-len(v) * q // 100) - 1))]


async def one_request(client, prompt: str | list[int], max_tokens: int, timeout: float | None = None) -> dict:
    """One greedy streamed completion of `max_tokens` tokens (ignore_eos): `ttft` to the first chunk
    with text, `tpot` over the tokens after the first, `latency`, and the completion tokens the server
    counted (the chunks with text, for a server that sends no usage); `ok` False (with `status`) for
    an HTTP error status or no text."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = chunks = 0
    options = {} if timeout is None else {"timeout": timeout}
    async with client.stream("POST", "/v1/completions", json=body, **options) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    end = time.perf_counter()
    tokens = tokens or chunks
    if first is None:
        return {"ok": False, "status": "no tokens"}
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return {"ok": True, "ttft": first - t0, "tpot": tpot, "latency": end - t0, "tokens": tokens}
