"""The CPU suite never initialises CUDA in a process that forks ranks (tests/conftest.py).

On a machine with CUDA, a Trainer on `train.device=auto` in the pytest process would put the model
on the GPU, and every rank forked afterwards would fail ("Cannot re-initialize CUDA in forked
subprocess"). These checks run here, without CUDA: they look at what the tests ask for, which
is the same on every machine.
"""

from __future__ import annotations

import pytest
import torch

import tests.forked_ranks as testing
from tessera.config.schema import load_config
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink


def _nothing() -> int:
    return 0


def test_shared_test_overrides_pin_the_cpu():
    for config, overrides in ((TINY_DENSE, shrink("data", "run", 1)), (TINY_MOE, moe_shrink("data", "run", 1))):
        assert "train.device=cpu" in overrides
        assert load_config(config, overrides).train.device == "cpu"


def test_a_cpu_test_asking_for_another_device_fails_at_once(small_dataset, tmp_path):
    """The suite's guard: a test that is not marked `gpu` and builds a Trainer on auto (cuda on a
    GPU machine) fails here too, on the CPU, naming the setting."""
    for device in ("auto", "cuda"):
        overrides = shrink(small_dataset, tmp_path / device, 1, **{"train.device": device})
        with pytest.raises(AssertionError, match=f"train.device='{device}': CPU tests must pin train.device=cpu"):
            Trainer(load_config(TINY_DENSE, overrides))


def test_run_ranks_refuses_a_parent_that_initialised_cuda(monkeypatch):
    """No CUDA here, so the parent's CUDA state is set by hand; tests/gpu checks the real thing."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(testing.CudaInitializedError, match="already initialised CUDA, which a forked child"):
        testing.run_ranks(_nothing, 1)
    monkeypatch.undo()
    assert testing.run_ranks(_nothing, 1) == [0]
