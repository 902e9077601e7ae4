"""bench/cpu_attention.py runs (on a small geometry) and its kernel and SDPA compute the same
attention in every case it times; its timings themselves live in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def test_the_attention_bench_times_equal_outputs_in_every_case():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_attention.py"), "--heads", "2", "--head-dim", "16",
                          "--threads", "1", "--repeats", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert [(c["chunk"], c["position"], c["sdpa"]) for c in result["cases"]] == [
        (512, 0, "is_causal"), (1024, 0, "is_causal"), (300, 200, "mask"), (128, 384, "mask")]
    assert all(c["max_abs_diff"] < 1e-5 and c["kernel_ms"] > 0 and c["sdpa_ms"] > 0 for c in result["cases"])
