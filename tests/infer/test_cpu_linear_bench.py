"""bench/cpu_linear.py runs (on small shapes) and both kernels it times compute F.linear's product;
its timings themselves live in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def test_the_linear_bench_times_equal_products_in_every_case():
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        pytest.skip("this torch has no oneDNN linear")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_linear.py"), "--shapes", "64:40", "48:16",
                          "--rows", "1", "7", "--bytes", "1e5", "--threads", "1", "--repeats", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(run.stdout)["cases"]
    assert [(c["in"], c["out"], c["rows"]) for c in cases] == [(64, 40, 1), (64, 40, 7), (48, 16, 1), (48, 16, 7)]
    assert all(c["max_abs_diff_vs_f_linear"] < 1e-4 and c["panel_us"] > 0 and c["onednn_us"] > 0 for c in cases)
