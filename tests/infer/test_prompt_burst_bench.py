"""bench/prompt_burst.py runs on a tiny model: it profiles the steps that hold prompt chunks, and
every request of the burst comes back with the tokens it asked for; its timings live in
docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.hang_guard import HANG_S
from tests.infer.tiny_models import write_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_burst_bench_profiles_the_prompt_steps_and_serves_every_request(tmp_path):
    write_model(tmp_path, "llama")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "prompt_burst.py"), "--model", str(tmp_path),
                          "--requests", "6", "--prompt-range", "20", "60", "--output-range", "2", "5",
                          "--max-num-batched-tokens", "64", "--max-model-len", "128"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    # 6 prompts of 20-60 tokens through steps of 64 tokens: more than one prompt step, fewer than all
    assert 2 <= result["prompt_steps"] < result["steps"]
    assert result["prompt_steps_ms"] > 0 and result["burst_s"] > 0 and result["prompt_ops_ms"]
    lengths = [len(t) for t in result["tokens"]]
    assert len(lengths) == 6 and all(2 <= n <= 5 for n in lengths)
