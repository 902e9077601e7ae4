"""Suite-wide rules that keep the CPU tests CPU-only on machines that have CUDA.

The multi-process tests fork their ranks (tests.forked_ranks), and a forked child cannot use
CUDA once its parent has initialised it. So:
  - tests marked `gpu` are skipped where CUDA is absent; they start their processes with spawn;
  - every other test must pin `train.device=cpu`: a Trainer that resolves any other device in a
    test not marked `gpu` fails the test at once, naming the device it was given (the check runs
    on every machine, so a missing pin is caught on CPU-only CI too, not only on a user's GPU box);
  - a test not marked `gpu` that leaves CUDA initialised fails, naming itself, instead of making
    every later forked test fail with "Cannot re-initialize CUDA in forked subprocess";
  - this process runs its first backward below, with the GPUs hidden, so that autograd never
    starts the per-GPU threads that would make every later forked rank's backward fail.
"""

from __future__ import annotations

import os

# CUDA availability checks through NVML, which does not initialise CUDA in this process
# (torch.cuda.is_available() otherwise creates a driver context that forked children inherit), and
# which sees the GPUs that the first backward below is run without. Set, not defaulted: the CUDA
# runtime of this process never sees a GPU (it starts with none visible, below), so a count taken
# through it would skip every `gpu` test on a GPU machine. Nothing in this process may use CUDA.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
# torch.compile in this process compiles in it: no inductor worker pool that forked ranks would
# inherit without its threads (a job handed to it there never finishes).
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
# Autograd starts a worker thread per GPU the first time backward runs in a process, and a forked
# child of a process that has them cannot run backward ("Unable to handle autograd's threading in
# combination with fork-based multiprocessing"). This process runs backward itself (one-process
# tests) and forks ranks that do: so its first backward runs here, with the GPUs hidden, and starts
# no device thread; the engine decides that once per process. On a CUDA build of torch without a
# GPU the same happened as soon as torch.compile or DTensor set up their stand-in CUDA device guard.
# The GPUs are visible again afterwards to what the `gpu` tests spawn.
_visible_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

torch.ones(1, requires_grad=True).sum().backward()
if _visible_gpus is None:
    del os.environ["CUDA_VISIBLE_DEVICES"]
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = _visible_gpus

import tessera.train.run.layout as run_layout  # noqa: E402

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

    def resolve(name: str, local_rank: int | None = None, key: str = "device") -> str:
        if name != CPU_ONLY:
            raise AssertionError(f"a CPU test built a Trainer with train.device={name!r}: CPU tests must pin "
                                 "train.device=cpu (tests.train.runs.shrink does), or be marked `gpu`")
        return original(name, local_rank, key)

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
