"""GPU presets: what one GPU of each kind can do, from the vendor's datasheet, plus the few
constants of the time model that belong to the hardware (one set per GPU type, for every run).

Datasheet figures (dense, no structured sparsity; bandwidth per direction per GPU):

- A100 SXM4 80GB (NVIDIA A100 Tensor Core GPU datasheet, 2021): 312 TFLOP/s bf16/fp16, 156 tf32,
  19.5 fp32, no fp8; 80 GB HBM2e at 2,039 GB/s; NVLink 3 600 GB/s bidirectional = 300 GB/s per
  direction. Network: one 200 Gb/s HDR InfiniBand NIC per GPU in DGX A100 / Selene = 25 GB/s.
- H100 SXM5 (NVIDIA H100 Tensor Core GPU datasheet, 2023): 989 TFLOP/s bf16/fp16 (1,979 with
  sparsity), 1,979 fp8, 495 tf32, 67 fp32; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s
  bidirectional = 450 GB/s per direction. Network: one 400 Gb/s ConnectX-7 per GPU in DGX H100 =
  50 GB/s.
- H800 SXM5 (NVIDIA H800 datasheet; DeepSeek-V3 technical report, arXiv 2412.19437, section
  3.1): the H100's compute and memory, NVLink cut to 400 GB/s bidirectional = 200 GB/s per
  direction; 400 Gb/s InfiniBand per GPU = 50 GB/s.
- H200 SXM (NVIDIA H200 Tensor Core GPU datasheet, 2024): the H100's compute, 141 GB HBM3e at
  4.8 TB/s, NVLink 4 at 450 GB/s per direction, 400 Gb/s network per GPU = 50 GB/s.
- H100 96 GB (torchtitan's benchmarks, pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md:
  Grand Teton hosts, "96GB HBM2e with 2.4 TB/sec", NVLink inside the host, 400 Gb/s RDMA per GPU,
  a 500 W power limit, "the actual peak TFLOPs number is between SXM and NVL"): the H100 SXM's
  datasheet figures otherwise; the time model therefore takes the SXM peak, an upper bound there.
- B200 (NVIDIA HGX B200 / DGX B200 datasheet, 2024: 72 PFLOP/s fp8 training and 1,440 GB HBM3e at
  64 TB/s for 8 GPUs; 36 PFLOP/s bf16 with sparsity): 2,250 TFLOP/s bf16 dense, 4,500 fp8 dense,
  1,100 tf32, 80 fp32; 180 GB at 8 TB/s; NVLink 5 1.8 TB/s bidirectional = 900 GB/s per
  direction; 400 Gb/s ConnectX-7 per GPU = 50 GB/s.

Time-model constants (what kernels and NCCL reach of those peaks; see roofline.py):
- `matmul_efficiency`: the share of peak a large bf16 GEMM sustains in training. Published cuBLAS
  figures: about 80% on A100 (sustained under 400 W), about 70-75% on H100/H800/H200 (power- and
  clock-limited below the 1,980 MHz the peak assumes), lower still on B200's first software.
- `attention_efficiency`: the share of peak a fused (flash) attention forward + backward reaches
  at long sequences (FlashAttention-2 on A100 ~ 50-70% forward, less backward; FlashAttention-3
  on H100 ~ 50-75%).
- `nvlink_efficiency`, `network_efficiency`: bus bandwidth NCCL reaches of the link's peak on
  large messages (nccl-tests: ~80% of NVLink, ~90% of InfiniBand).
- `nvlink_latency`, `network_latency`: the fixed cost of one collective step (seconds).

Host link (activation offload): the datasheets' PCIe bandwidth, both directions together, halved:
A100 PCIe Gen4 64 GB/s -> 32 GB/s per direction; H100, H800, H200 PCIe Gen5 128 GB/s -> 64 GB/s.
B200: taken as the same PCIe Gen5 x16 (64 GB/s per direction), an assumption, not a datasheet figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.config.errors import ConfigError

T = 1e12
GB = 1e9
GiB = 2**30  # HBM capacities: the datasheets' "80 GB" parts hold 80 GiB (81,920 MiB of which the
# driver shows 81,559 MiB on an H100), so memory sizes are read as binary units.


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: dict[str, float] = field(hash=False)  # dense FLOP/s by compute dtype
    memory: float  # bytes of HBM
    memory_bandwidth: float  # HBM bytes/s
    nvlink_bandwidth: float  # bytes/s per direction per GPU inside a node
    network_bandwidth: float  # bytes/s per direction per GPU across nodes
    matmul_efficiency: float
    attention_efficiency: float
    host_bandwidth: float = 64 * 1e9  # bytes/s per direction to host memory (PCIe)
    nvlink_efficiency: float = 0.8
    network_efficiency: float = 0.9
    nvlink_latency: float = 8e-6
    network_latency: float = 20e-6

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ConfigError(f"dtype {dtype!r} has no peak on {self.name}: one of {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]


# Dense peak FLOP/s by compute dtype of each GPU generation (the datasheets above).
_A100_PEAKS = {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}
_H100_PEAKS = {"bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T, "tf32": 495 * T, "fp32": 67 * T}  # H800, H200 too
_B200_PEAKS = {"bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T, "tf32": 1100 * T, "fp32": 80 * T}

# name, peaks, HBM GiB, HBM GB/s, NVLink, network and host (PCIe) GB/s per direction, matmul and attention
# efficiency
_PRESETS = (
    ("a100", _A100_PEAKS, 80, 2039, 300, 25, 32, 0.80, 0.50),
    ("h100", _H100_PEAKS, 80, 3350, 450, 50, 64, 0.72, 0.50),
    ("h800", _H100_PEAKS, 80, 3350, 200, 50, 64, 0.72, 0.50),
    ("h200", _H100_PEAKS, 141, 4800, 450, 50, 64, 0.74, 0.50),
    ("h100-96gb", _H100_PEAKS, 96, 2400, 450, 50, 64, 0.72, 0.50),
    ("b200", _B200_PEAKS, 180, 8000, 900, 50, 64, 0.65, 0.45),
)

GPUS: dict[str, GpuSpec] = {
    name: GpuSpec(name, dict(peaks), memory=hbm * GiB, memory_bandwidth=hbm_bw * GB, nvlink_bandwidth=nvlink * GB,
                  network_bandwidth=network * GB, host_bandwidth=host * GB, matmul_efficiency=matmul,
                  attention_efficiency=attention)
    for name, peaks, hbm, hbm_bw, nvlink, network, host, matmul, attention in _PRESETS
}


def get_gpu(name: str) -> GpuSpec:
    key = name.lower()
    if key not in GPUS:
        raise ConfigError(f"--gpu={name!r} is invalid: one of {', '.join(GPUS)}")
    return GPUS[key]
