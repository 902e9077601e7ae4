"""`keep_freed_memory` (tessera serve on CPU): after it, a step's freed activations of megabytes stay
in the process for the next step instead of going back to the kernel (whose pages the next step
would fault in again); without it, glibc hands such blocks back as it frees them. Each case runs in
a fresh process, since the allocator's settings are the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.hang_guard import HANG_S
from tests.train.runs import ROOT

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from tessera.infer.cpu.memory import keep_freed_memory

    took = keep_freed_memory() if sys.argv[1] == "keep" else None
    page = os.sysconf("SC_PAGE_SIZE")
    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    kept = []
    for step in range(4):  # a step's activations, each step's larger (longer prompt chunks), then freed
        sizes = [round(n * 1.4**step) for n in (4, 8, 11)]
        blocks = [torch.ones(n * 2**20 // 4) for n in sizes]
        before_free = resident()
        del blocks
        kept.append((resident() - before_free + sum(sizes) * 2**20) / (sum(sizes) * 2**20))
    print(json.dumps({"took": took, "kept": kept}))
""")


def _run(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env,
                         timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator on Linux")
def test_freed_activations_stay_in_the_process_only_when_asked():
    kept, default = _run("keep"), _run("default")
    assert kept["took"] is True
    # the fraction of each step's freed activations still resident: kept, all of it; by default, each
    # step's blocks that are larger than any freed before go back to the kernel as they are freed
    assert min(kept["kept"]) > 0.95
    assert max(default["kept"]) < 0.7
