"""Suite-wide rules that keep the CPU tests CPU-only on machines that have CUDA.

The multi-process tests fork their ranks (tessera.parallel.testing), and a forked child cannot use
CUDA once its parent has initialised it. So:
  - tests marked `gpu` are skipped where CUDA is absent; they start their processes with spawn;
  - every other test must pin `train.device=cpu`: a Trainer that resolves any other device in a
    test not marked `gpu` fails the test at once, naming the device it was given (the check runs
    on every machine, so a missing pin is caught on CPU-only CI too, not only on a user's GPU box);
  - a test not marked `gpu` that leaves CUDA initialised fails, naming itself, instead of making
    every later forked test fail with "Cannot re-initialize CUDA in forked subprocess".
"""

from __future__ import annotations

import os

# CUDA availability checks through NVML, which does not initialise CUDA in this process
# (torch.cuda.is_available() otherwise creates a driver context that forked children inherit).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# torch.compile in this process compiles in it: no inductor worker pool that forked ranks would
# inherit without its threads (a job handed to it there never finishes).
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import tessera.train.run_layout as run_layout  # noqa: E402

CPU_ONLY = "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no CUDA device here)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def cpu_only_resolve_device(original):
    """`resolve_device` that refuses every device but cpu (what a CPU test must ask for)."""

    def resolve(name: str, local_rank: int | None = None) -> torch.device:
        if name != CPU_ONLY:
            raise AssertionError(f"a CPU test built a Trainer with train.device={name!r}: CPU tests must pin "
                                 "train.device=cpu (tests.train.runs.shrink does), or be marked `gpu`")
        return original(name, local_rank)

    return resolve


@pytest.fixture(autouse=True)
def cpu_tests_stay_on_cpu(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    monkeypatch.setattr(run_layout, "resolve_device", cpu_only_resolve_device(run_layout.resolve_device))
    was_initialised = torch.cuda.is_initialized()
    yield
    if not was_initialised and torch.cuda.is_initialized():
        pytest.fail(f"{request.node.nodeid} initialised CUDA in the pytest process, which later forks ranks: "
                    "pin it to cpu or mark it `gpu` (and spawn its processes)")
