"""`train.dtype` and `train.fp8` as the trainer runs them.

bf16 and fp16 compute under autocast over fp32 master weights (fp16 with dynamic loss scaling:
loss_scaler.py). `train.fp8=true` converts the blocks' linear layers to FP8 (models/float8.py) on
top of bf16: it needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell)
and is refused elsewhere, with what it needs, rather than silently training in another precision.
"""

from __future__ import annotations

import torch

from tessera.config.errors import ConfigError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: no autocast
FP8_MIN_CAPABILITY = (8, 9)
CUDA_LOSS_CHUNK_TOKENS = 4096  # [4096, V] fp32 logits per chunk: 2 GiB at V = 128k


def loss_chunk_tokens(setting: int | None, device: torch.device) -> int:
    """`train.loss_chunk_tokens` as run on `device`: None is on for CUDA, off (0) elsewhere."""
    if setting is None:
        return CUDA_LOSS_CHUNK_TOKENS if device.type == "cuda" else 0
    return setting


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """The autocast compute dtype of `train.dtype` (None for fp32)."""
    return AUTOCAST_DTYPES.get(dtype)


def check_fp8(enabled: bool, device: torch.device, dtype: str = "bf16", tp: int = 1) -> None:
    """Refuse `train.fp8=true` where it cannot run, saying what it needs and what this run has."""
    if not enabled:
        return
    if dtype != "bf16":
        raise ConfigError(f"train.fp8=true is invalid with train.dtype={dtype}: FP8 linear layers run on top of "
                          "bf16 compute (activations, attention and the other layers); set train.dtype=bf16")
    if tp > 1:
        raise ConfigError(f"train.fp8=true is invalid with parallel.tp={tp}: FP8 linear layers take whole "
                          "weights, not tensor-parallel shards; set parallel.tp=1 (FSDP, pipeline, expert and "
                          "context parallelism compose with FP8) or train.fp8=false")
    if device.type != "cuda":
        raise ConfigError(f"train.fp8=true is invalid on {device}: FP8 needs a CUDA GPU with FP8 tensor cores "
                          "(compute capability >= 8.9: Ada, Hopper or newer); set train.fp8=false")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY or torch.version.hip is not None:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"train.fp8=true is invalid on {name} (compute capability {capability[0]}.{capability[1]}): "
                          "FP8 needs an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper or newer); "
                          "set train.fp8=false")
