"""`tessera` bounds the OpenMP threads' spin (torch's intra-op pool, which the C++ kernels share) on a
shared machine: GOMP_SPINCOUNT=10000 is in the environment before any command imports torch, unless
the user chose a policy, which is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tessera.cli.threads import apply_thread_defaults
from tests.train.runs import ROOT

PROBE = """
import os, sys
from tessera.cli import main
main(["plan", "configs/tiny-dense.yaml", "--gpus", "1"])
import torch
print("policy", os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), file=sys.stderr)
"""


@pytest.mark.parametrize("given, expected", [({}, "policy None 10000"),
                                             ({"OMP_WAIT_POLICY": "ACTIVE"}, "policy ACTIVE None"),
                                             ({"GOMP_SPINCOUNT": "1000"}, "policy None 1000")])
def test_the_policy_is_set_before_torch_unless_chosen(given, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, **given, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert expected in done.stderr


def test_apply_returns_what_it_set():
    environ: dict[str, str] = {}
    assert apply_thread_defaults(environ) == {"GOMP_SPINCOUNT": "10000"} == environ
    assert apply_thread_defaults({"GOMP_SPINCOUNT": "0"}) == {}
