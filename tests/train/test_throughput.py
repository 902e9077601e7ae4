"""Throughput figures: MFU from the documented FLOP count and a peak looked up or configured."""

from __future__ import annotations

import pytest
import torch

from tessera.config import get_preset
from tessera.models.flops import flops_per_token
from tessera.train.run.throughput import PEAK_BF16_FLOPS, peak_flops_for_device, step_throughput


def test_peaks():
    assert peak_flops_for_device(torch.device("cpu")) is None
    assert peak_flops_for_device(torch.device("cpu"), 2e12) == 2e12
    table = dict(PEAK_BF16_FLOPS)
    assert table["H100"] == 989e12 and table["A100"] == 312e12
    names = [k for k, _ in PEAK_BF16_FLOPS]  # a longer name is tried before its prefix
    assert names.index("H100 PCIe") < names.index("H100") and names.index("L40S") < names.index("L4")


def test_step_throughput_uses_flops_per_token():
    cfg = get_preset("tiny-llama")
    f = flops_per_token(cfg, 64)
    out = step_throughput(tokens=1000, seconds=0.5, flops_per_token=f, peak=1e12)
    assert out["tokens_per_s"] == 2000
    assert out["tflops"] == pytest.approx(2000 * f / 1e12)
    assert out["mfu"] == pytest.approx(2000 * f / 1e12)
    assert step_throughput(1000, 0.5, f, None)["mfu"] is None
