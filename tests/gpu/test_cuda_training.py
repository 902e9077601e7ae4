"""Training on CUDA, next to the CPU suite (marked `gpu`: skipped where CUDA is absent).

The pytest process forks the CPU tests' ranks, so it must never initialise CUDA itself: every
CUDA computation here runs in a spawned child (`in_spawned_process`, a fresh interpreter), and
the losses come back as plain numbers. Tolerances follow the numerics contract
(docs/architecture.md, "Numerics contract"): bf16 within 5e-3 relative of fp32, compiled within
1e-5 of eager in fp32.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.train.runs import ROOT, TINY_DENSE, TINY_MOE, moe_shrink, read_losses, set_args, shrink

pytestmark = pytest.mark.gpu
STEPS = 5
CONFIGS = {"dense": (TINY_DENSE, shrink), "moe": (TINY_MOE, moe_shrink)}


def in_spawned_process(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a fresh (spawned, not forked) interpreter; its return value comes back pickled."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def train_losses(model: str, dataset: str, run_dir: str, steps: int, extra: dict) -> list[float]:
    """Runs in the child: the real Trainer; the logged losses."""
    from tessera.config.schema import load_config
    from tessera.train.trainer import Trainer

    config, shrink_fn = CONFIGS[model]
    overrides = shrink_fn(dataset, run_dir, steps, **{"checkpoint.interval": 0, "optim.eps": 1e-3, **extra})
    return [r["loss"] for r in Trainer(load_config(config, overrides)).train().records]


def run_ranks_after_cuda_init() -> str:
    """Runs in the child: initialise CUDA, then ask the fork harness for ranks."""
    import torch

    from tests.forked_ranks import CudaInitializedError, run_ranks

    torch.zeros(1, device="cuda")
    try:
        run_ranks(int, 1)
    except CudaInitializedError as e:
        return str(e)
    return "not refused"


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_bf16_cuda_training_follows_fp32_cpu(small_dataset, tmp_path, model):
    cpu = in_spawned_process(train_losses, model, small_dataset, str(tmp_path / "cpu"), STEPS,
                             {"train.device": "cpu", "train.dtype": "fp32"})
    cuda = in_spawned_process(train_losses, model, small_dataset, str(tmp_path / "cuda"), STEPS,
                              {"train.device": "cuda", "train.dtype": "bf16"})
    assert len(cuda) == len(cpu) == STEPS
    for got, want in zip(cuda, cpu, strict=True):
        assert abs(got - want) <= 5e-3 * want, (cuda, cpu)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_compiled_equals_eager_on_cuda(small_dataset, tmp_path, model):
    losses = {flag: in_spawned_process(train_losses, model, small_dataset, str(tmp_path / str(flag)), 3,
                                       {"train.device": "cuda", "train.compile": flag})
              for flag in (False, True)}
    for got, want in zip(losses[True], losses[False], strict=True):
        assert abs(got - want) <= 1e-5 * want, losses


def fp8_tensor_cores() -> bool:
    """Runs in the child: whether this GPU has FP8 tensor cores (compute capability >= 8.9)."""
    import torch

    return torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_fp8_cuda_training_follows_bf16(small_dataset, tmp_path, model):
    """`train.fp8=true` on FP8 tensor cores: 5 steps within 1% of bf16 (CPU: within 0.3%,
    tests/train/test_precision.py), not bf16 itself."""
    if not in_spawned_process(fp8_tensor_cores):
        pytest.skip("needs FP8 tensor cores (compute capability >= 8.9)")
    losses = {fp8: in_spawned_process(train_losses, model, small_dataset, str(tmp_path / str(fp8)), STEPS,
                                      {"train.device": "cuda", "train.dtype": "bf16", "train.fp8": fp8})
              for fp8 in (False, True)}
    assert len(losses[True]) == STEPS and losses[True] != losses[False]
    for got, want in zip(losses[True], losses[False], strict=True):
        assert abs(got - want) <= 1e-2 * want, losses


def test_one_rank_run_through_nproc_1(small_dataset, tmp_path):
    """`tessera train --nproc 1` on the GPU is one rank in an NCCL process group (a subprocess: its
    CUDA never touches this process)."""
    run = tmp_path / "run"
    overrides = shrink(small_dataset, run, 2, **{"train.device": "cuda", "train.dtype": "bf16"})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", TINY_DENSE, *set_args(overrides), "--nproc", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    layout = next(line for line in proc.stderr.splitlines() if line.startswith("layout: "))
    assert layout.startswith("layout: 1 rank on cuda:0, ") and "nccl" in layout, layout  # a one-rank NCCL group
    losses = read_losses(run)
    assert sorted(losses) == [1, 2] and all(7.0 < v < 9.0 for v in losses.values())
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["mem_gib"] > 0  # CUDA memory: the run was on the GPU


def test_fork_harness_refuses_after_cuda_was_initialised():
    message = in_spawned_process(run_ranks_after_cuda_init)
    assert "already initialised CUDA" in message, message


@pytest.mark.slow
def test_forked_cpu_tests_pass_with_cuda_present():
    """The failure this suite had on GPU machines: forked-rank CPU tests with CUDA visible."""
    # one-process training (backward in the pytest process) first, then ranks forked from it that run
    # backward: autograd's GPU threads, had the first backward started them, would fail those ranks
    files = ["tests/train/test_trainer.py", "tests/parallel/test_harness.py",
             "tests/parallel/test_gradient_accumulation_sync.py", "tests/parallel/test_cpu_pinning.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
