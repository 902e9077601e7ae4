"""bench/tool_calls.py runs on a tiny random model: every constrained call it times validates, and
each unconstrained twin decodes exactly as many tokens, so that the two sides' decode rates compare
like with like; its figures live in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hang_guard import HANG_S
from tests.infer.agent_models import QWEN25_TEMPLATE, write_agent_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_tool_call_bench_times_valid_calls_against_twins_of_their_length(tmp_path):
    pytest.importorskip("llguidance")
    pytest.importorskip("jsonschema")
    write_agent_model(tmp_path, QWEN25_TEMPLATE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tool_calls.py"), "--model", str(tmp_path),
                          "--batch", "2", "--repeats", "2", "--max-tokens", "600"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)["batch_2"]
    assert result["valid_calls"] == "4/4"  # the bench itself asserts the twins' token counts are equal
    assert result["constrained"]["tokens_per_request"] == result["unconstrained"]["tokens_per_request"] > 20
    assert result["decode_ratio"] > 0 and len(result["decode_ratios"]) == 2
