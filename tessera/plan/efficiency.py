"""Efficiency profiles: what share of a GPU's peak each class of operator reaches, per framework.

The time model (op_time.py) prices every operator from its shape and three efficiencies: large
matrix products at `matmul` x peak, the fused attention core at `attention` x peak at long
sequences, elementwise work as `elementwise_passes` reads/writes of its tensors at HBM bandwidth.
Those depend on the kernels a framework runs, so they come in named profiles (`--efficiency NAME`):

- "megatron": Megatron-class kernels (cuBLAS GEMMs, FlashAttention/cuDNN fused attention, fused
  elementwise kernels). Its per-GPU values are the presets' (gpus.py), chosen with the calibration
  runs of `tessera plan validate` in view (tessera/plan/published.py marks which). FITTED.
- "tessera": this project's own kernels: the same cuBLAS GEMMs through torch (same matmul share);
  the attention core through torch's scaled_dot_product_attention, whose flash kernel is
  FlashAttention-2, which reaches 50-73% of peak forward on A100 (Dao 2023, arXiv 2307.08691) but
  about 35% on H100 (Shah et al. 2024, arXiv 2407.08608: "FlashAttention-2 achieves only 35%
  utilization on H100"); elementwise work at two passes, as torch.compile fuses it in the blocks
  it compiles (`train.compile`, on by default on CUDA). These are priors, not measurements: the
  profile is UNFITTED until this project's GPU runs are measured (bench/, docs/benchmarks.md
  holds none yet) and the values are fitted to them.

- "torch-eager": torch's kernels without torch.compile (torchtitan's runs without it): GEMMs and
  the attention core as "tessera", elementwise work as the separate kernels eager PyTorch runs.
  Counted on torchtitan's Llama block (pytorch/torchtitan torchtitan/models/llama/model.py and
  norms.py, December 2024), bytes per token in bf16 for hidden h, query width q, key/value width
  kv and FFN width f: each RMSNorm casts to fp32, squares, averages, scales, casts back and
  multiplies by its weight (36 h; two per block), two residual adds (6 h each), RoPE casts q and k
  to fp32, multiplies them as complex numbers and casts back (20 (q + kv)), GQA's repeat_kv copies
  k and v to every query head (4 q + 4 kv), SwiGLU's silu and product (10 f): 84 h + 24 q + 24 kv
  + 10 f, against the 20 h + 4 q + 4 kv + 6 f the time model counts per pass (op_time.py). For
  Llama 3.1 8B (4096, 4096, 1024, 14336) that is 610,304 / 188,416 = 3.24 passes, for Llama 3.1
  70B (8192, 8192, 1024, 28672) 3.21: ELEMENTWISE_PASSES_EAGER. UNFITTED, like "tessera".

A float given to `--efficiency` replaces only the large-GEMM share of the chosen GPU, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.config.choices import lookup_choice

HOPPER = ("h100", "h800", "h200", "h100-96gb")
ELEMENTWISE_PASSES_EAGER = 3.24  # the count of "torch-eager" (module docstring)
# FlashAttention-2's share of peak (module docstring), the attention core of torch's kernels
TORCH_ATTENTION = {**{g: 0.35 for g in HOPPER}, "b200": 0.35}


@dataclass(frozen=True)
class EfficiencyProfile:
    name: str
    fitted: bool
    note: str  # one line for plans and validation
    attention: dict[str, float] = field(default_factory=dict, hash=False)  # GPU -> share; absent: the preset's
    matmul: dict[str, float] = field(default_factory=dict, hash=False)  # GPU -> share; absent: the preset's
    elementwise_passes: float = 2.0

    def attention_efficiency(self, gpu: str, preset: float) -> float:
        return self.attention.get(gpu, preset)

    def matmul_efficiency(self, gpu: str, preset: float) -> float:
        return self.matmul.get(gpu, preset)


PROFILES = {
    "megatron": EfficiencyProfile(
        "megatron", True, "Megatron-class kernels, fitted with the calibration runs of tessera plan validate"),
    "tessera": EfficiencyProfile(
        "tessera", False, "Tessera's own kernels: UNFITTED priors (no GPU measurements in docs/benchmarks.md yet)",
        attention=TORCH_ATTENTION),
    "torch-eager": EfficiencyProfile(
        "torch-eager", False, "torch's kernels without torch.compile: UNFITTED priors, elementwise passes counted "
        "on torchtitan's eager Llama block", attention=TORCH_ATTENTION, elementwise_passes=ELEMENTWISE_PASSES_EAGER),
}
DEFAULT_PROFILE = "megatron"


def get_profile(name: str) -> EfficiencyProfile:
    return lookup_choice(PROFILES, name, "--efficiency")
