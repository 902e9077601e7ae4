"""The hardware a plan is made for: GPUs, their memory and peak FLOP/s, and two links.

`Cluster.for_gpu("h100", gpus=64)` takes everything from a preset (tessera/plan/gpus.py). The
plain defaults are the same H100 SXM node: 8 GPUs, 80 GiB, 989 TFLOP/s dense bf16, NVLink 4 at
450 GB/s per direction per GPU and one 400 Gb/s NIC per GPU (50 GB/s), each at the share NCCL
reaches (80% and 90%). Bandwidths are what a collective achieves per GPU (bus bandwidth); set
them to a measured nccl-tests figure when there is one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from tessera.config.errors import ConfigError, require
from tessera.plan.efficiency import DEFAULT_PROFILE, get_profile
from tessera.plan.gpus import get_gpu

_BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_bytes(text: str | float | int, key: str = "size") -> float:
    """'80GiB' -> 85899345920.0, '141GB' -> 1.41e11, a bare number is bytes."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _BYTE_UNITS:
            raise ConfigError(f"{key}={text!r} is invalid: a number of bytes with an optional unit "
                              f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GiB")
        try:
            value = float(m.group(1)) * _BYTE_UNITS[unit]
        except ValueError as e:
            raise ConfigError(f"{key}={text!r} is invalid: {m.group(1)!r} is not a number") from e
    if value <= 0:
        raise ConfigError(f"{key}={text!r} is invalid: must be > 0")
    return value


def parse_rate(text: str | float | int, key: str, unit: str) -> float:
    """'450GB/s' -> 4.5e11, '989T' or '989e12' -> 9.89e14 (unit is 'B/s' or 'FLOP/s')."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        pattern = r"\s*([0-9.eE+-]+)\s*([kKmMgGtTpP]?)\s*(?:" + re.escape(unit) + r"|" + re.escape(
            unit.split("/")[0]) + r")?\s*"
        m = re.fullmatch(pattern, str(text), flags=re.IGNORECASE)
        if m is None:
            raise ConfigError(f"{key}={text!r} is invalid: a number with an optional k/M/G/T/P prefix "
                              f"and unit {unit}, e.g. 450G{unit}")
        try:
            value = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
        except ValueError as e:
            raise ConfigError(f"{key}={text!r} is invalid: {m.group(1)!r} is not a number") from e
    if value <= 0:
        raise ConfigError(f"{key}={text!r} is invalid: must be > 0")
    return value


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. `efficiency` is the share of peak FLOP/s a large matrix product sustains
    (smaller ones reach less: tessera/plan/op_time.py), `attention_efficiency` that of the fused
    attention core at long sequences; `reserved_bytes` is what the CUDA context, NCCL and
    allocator fragmentation take from each GPU before the model sees any memory. Latencies are
    the fixed cost of one step of a collective on each link."""

    gpus: int
    gpus_per_node: int = 8
    gpu_memory: float = 80 * 2**30
    gpu_flops: float = 989e12
    intra_node_bandwidth: float = 360e9
    inter_node_bandwidth: float = 45e9
    efficiency: float = 0.72
    reserved_bytes: float = 3 * 2**30
    memory_bandwidth: float = 3.35e12  # HBM bytes/s (H100 SXM): elementwise work and the optimizer step
    host_bandwidth: float = 64e9  # bytes/s per direction to host memory (PCIe Gen5 x16): activation offload
    elementwise_passes: float = 2.0  # reads/writes of each elementwise tensor (the efficiency profile's)
    profile: str = "megatron"  # the efficiency profile the shares come from (efficiency.py)
    attention_efficiency: float = 0.5
    intra_node_latency: float = 8e-6
    inter_node_latency: float = 20e-6
    gpu: str = "h100"

    @classmethod
    def for_gpu(cls, name: str, gpus: int, gpus_per_node: int = 8, dtype: str = "bf16",
                profile: str = DEFAULT_PROFILE, **overrides: float) -> Cluster:
        """A cluster of `gpus` GPUs of a preset kind (a100, h100, h800, h200, b200, ...) with the
        operator efficiencies of `profile` (efficiency.py); `overrides` replace single fields (e.g. a
        measured inter_node_bandwidth)."""
        g, prof = get_gpu(name), get_profile(profile)
        values = dict(gpu_memory=g.memory, gpu_flops=g.peak(dtype), memory_bandwidth=g.memory_bandwidth,
                      intra_node_bandwidth=g.nvlink_bandwidth * g.nvlink_efficiency,
                      inter_node_bandwidth=g.network_bandwidth * g.network_efficiency,
                      efficiency=prof.matmul_efficiency(g.name, g.matmul_efficiency),
                      attention_efficiency=prof.attention_efficiency(g.name, g.attention_efficiency),
                      elementwise_passes=prof.elementwise_passes, profile=prof.name,
                      host_bandwidth=g.host_bandwidth,
                      intra_node_latency=g.nvlink_latency, inter_node_latency=g.network_latency, gpu=g.name)
        known = {f.name for f in fields(cls)}
        for key in overrides:
            if key not in known:
                raise ConfigError(f"cluster field {key!r} is invalid: one of {', '.join(sorted(known))}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(gpus=gpus, gpus_per_node=gpus_per_node, **values)

    def __post_init__(self) -> None:
        require(isinstance(self.gpus, int) and self.gpus >= 1, "gpus", self.gpus, "an integer >= 1")
        require(isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1, "gpus_per_node",
                self.gpus_per_node, "an integer >= 1")
        require(self.gpus <= self.gpus_per_node or self.gpus % self.gpus_per_node == 0, "gpus", self.gpus,
                f"at most one node or a multiple of gpus_per_node={self.gpus_per_node}")
        for key in ("gpu_memory", "gpu_flops", "intra_node_bandwidth", "inter_node_bandwidth", "memory_bandwidth",
                    "host_bandwidth"):
            require(getattr(self, key) > 0, key, getattr(self, key), "must be > 0")
        require(0 < self.efficiency <= 1, "efficiency", self.efficiency, "must be in (0, 1]")
        require(0 < self.attention_efficiency <= 1, "attention_efficiency", self.attention_efficiency,
                "must be in (0, 1]")
        for key in ("intra_node_latency", "inter_node_latency"):
            require(getattr(self, key) >= 0, key, getattr(self, key), "must be >= 0 seconds")
        require(0 <= self.reserved_bytes < self.gpu_memory, "reserved_bytes", self.reserved_bytes,
                "must be >= 0 and below gpu_memory")

    @property
    def usable_memory(self) -> float:
        return self.gpu_memory - self.reserved_bytes

    def group_bandwidth(self, size: int, stride: int) -> float:
        """Per-GPU bandwidth of a group of `size` ranks `stride` apart (ranks are numbered with the
        innermost mesh dimension fastest, so a node holds `gpus_per_node` consecutive ranks)."""
        if size <= 1:
            return float("inf")
        return self.intra_node_bandwidth if size * stride <= self.gpus_per_node else self.inter_node_bandwidth

    def group_latency(self, size: int, stride: int) -> float:
        """Seconds of one step of a collective on the link this group uses."""
        if size <= 1:
            return 0.0
        return self.intra_node_latency if size * stride <= self.gpus_per_node else self.inter_node_latency

    def collective_time(self, sent_bytes: float, size: int, stride: int) -> float:
        """Seconds of one collective call: log2(n) latency steps (NCCL's tree / LL protocols on small
        messages) plus the bytes a rank sends at the group's bus bandwidth."""
        if size <= 1:
            return 0.0
        steps = max(1, math.ceil(math.log2(size)))
        return steps * self.group_latency(size, stride) + sent_bytes / self.group_bandwidth(size, stride)
