"""bench/gpu_train.py runs end to end in its small-shape mode on the CPU and prints one JSON object
(the GPU figures themselves are only ever measured on a GPU, never here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tessera.models.counting import count_params
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT


@pytest.mark.slow
def test_gpu_train_bench_prints_one_json_object_tiny_on_cpu(small_dataset):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "bench/gpu_train.py", "--tiny", "--device", "cpu", "--steps", "1",
                          "--warmup", "1", "--set", f"data.datasets=[{{path: {small_dataset}}}]"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)  # the whole of stdout is the one object
    assert result["benchmark"] == "gpu_train" and result["device"] == "cpu" and result["tiny"] is True
    assert [r["model"] for r in result["results"]] == ["dense-1.15B", "moe-1.83B"]
    for entry in result["results"]:
        assert entry["active_params"] <= entry["params"]
        for side in ("tessera", "transformers"):
            figures = entry[side]
            assert figures["tokens_per_s"] > 0 and figures["step_seconds_median"] > 0
            assert figures["mfu"] is None and figures["peak_mem_gib"] is None  # no peak or CUDA memory on CPU
    moe = result["results"][1]
    assert moe["active_params"] < moe["params"]


def test_gpu_train_bench_models_have_the_published_shapes():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_train
    finally:
        sys.path.remove(str(ROOT / "bench"))
    dense = gpu_train.run_config("dense-1.15B", False, "cpu", "bf16", "unused", []).model
    moe_cfg = gpu_train.run_config("moe-1.83B", False, "cpu", "bf16", "unused", [])
    moe = moe_cfg.model
    assert (dense.dim, dense.n_layers, dense.n_heads, dense.n_kv_heads, dense.ffn_dim, dense.vocab_size) == (
        2048, 24, 16, 8, 5632, 4096)
    assert (moe.dim, moe.n_layers, moe.n_heads, moe.n_kv_heads, moe.vocab_size) == (2048, 12, 16, 8, 4096)
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.ffn_dim) == (8, 2, 2816)
    assert round(count_params(dense) / 1e9, 2) == 1.15
    assert (round(count_params(moe) / 1e9, 2), round(count_params(moe, active=True) / 1e9, 2)) == (1.83, 0.58)
    t = moe_cfg.train
    assert (t.seq_len, t.micro_batch_size, t.global_batch_size, t.dtype) == (2048, 4, 8, "bf16")


def test_gpu_train_bench_refuses_the_full_models_without_cuda():
    """Without CUDA (hidden here, so also on a GPU machine) and without --tiny it stops before building
    anything, with one message, instead of training the 1.15B model in fp32 on the CPU for hours (the
    timeout, far above the imports' few seconds, is what such a run would hit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "bench/gpu_train.py", "--steps", "1", "--warmup", "0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert "CUDA is not available" in run.stderr and "--tiny" in run.stderr
