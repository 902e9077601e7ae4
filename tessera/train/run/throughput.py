"""Throughput figures of a training step: tokens/s, model FLOP/s, MFU and memory.

MFU = achieved model FLOP/s / peak FLOP/s of the device (PaLM, Chowdhery et al. 2022,
appendix B). The model FLOPs of one token are `tessera.models.flops.flops_per_token` (the one
documented count, shared with the planner: matmuls only, 3x forward, causal attention counted as
half the score matrix) and the peak comes from `peak_flops_for_device` (dense bf16 tensor-core
figures; `log.peak_flops` overrides it). On a CPU there is no meaningful table, so MFU is None
unless a peak is configured.
"""

from __future__ import annotations

import resource
import sys

import torch

# Dense (no sparsity) bf16 peak FLOP/s by a substring of torch.cuda.get_device_name(); the first
# match wins, so longer names come before their prefixes (H100 PCIe before H100, L40S before L4).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def peak_flops_for_device(device: torch.device, configured: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `configured` if given, else the table entry for the GPU's name,
    else None (CPUs and unknown GPUs)."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS:
        if key in name:
            return peak
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process on `device`: allocated CUDA memory, or the resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def step_throughput(tokens: int, seconds: float, flops_per_token: float, peak: float | None,
                    num_devices: int = 1) -> dict[str, float | None]:
    """tokens/s, TFLOP/s per device and MFU for one optimizer step of `tokens` tokens."""
    seconds = max(seconds, 1e-9)
    tps = tokens / seconds
    flops_per_device = tps * flops_per_token / num_devices
    return {
        "tokens_per_s": tps,
        "tflops": flops_per_device / 1e12,
        "mfu": flops_per_device / peak if peak else None,
    }
