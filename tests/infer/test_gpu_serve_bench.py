"""bench/gpu_serve.py runs end to end in its small-shape mode on the CPU and prints one JSON object
(the GPU figures themselves are only ever measured on a GPU, never here); without CUDA it refuses
its full-size mode at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_serve_bench_prints_one_json_object_tiny_on_cpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "bench/gpu_serve.py", "--tiny", "--device", "cpu", "--batches", "1", "4",
                          "--repeats", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)  # the whole of stdout is the one object
    assert result["benchmark"] == "gpu_serve" and result["device"] == "cpu" and result["tiny"] is True
    assert (result["prompt_len"], result["new_tokens"]) == (16, 8)
    for side in ("llm", "http", "transformers_generate"):
        for batch in ("1", "4"):
            figures = result[side][batch]
            assert figures["tokens_per_s"] > 0 and figures["seconds_median"] > 0
    assert result["llm"]["eager_bucket_runs"] > 0 and result["llm"]["graph_replays"] == 0  # no graphs on CPU


@pytest.mark.slow
def test_load_test_mode_reports_throughput_and_latency_percentiles_on_cpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "bench/gpu_serve.py", "--load-test", "--tiny", "--device", "cpu",
                          "--clients", "4", "--requests", "8"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["benchmark"] == "gpu_serve_load" and "llm" not in result
    load = result["load"]
    assert (load["clients"], load["requests"]) == (4, 8) and load["tokens_per_s"] > 0
    for metric in ("ttft_s", "tpot_s"):
        p = load[metric]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert load["streamed_chunks"] >= 8  # every request streamed its text


@pytest.mark.parametrize("argv", [[], ["--device", "cpu"], ["--load-test"], ["--device", "cuda"]])
def test_without_cuda_the_full_size_benchmark_is_refused_at_once(argv, tmp_path):
    """Not a 1.15B model benchmarked for hours on the CPU: a message and exit status 2, before any
    model is written (CUDA hidden from the process, so this holds on a GPU machine too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "bench/gpu_serve.py", *argv], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=HANG_S)
    assert run.returncode == 2 and run.stdout == "", run.stderr[-3000:]
    assert ("without --tiny" in run.stderr or "CUDA is not available" in run.stderr) and "--tiny" in run.stderr
    assert list(tmp_path.iterdir()) == []  # no model was written
