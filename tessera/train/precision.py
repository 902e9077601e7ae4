"""`train.dtype` and `train.fp8` as the trainer runs them.

bf16 and fp16 compute under autocast over fp32 master weights (fp16 with dynamic loss scaling:
loss_scaler.py). FP8 linear layers need FP8 tensor cores (compute capability 8.9 or newer: Ada,
Hopper, Blackwell) and are not built yet, so `train.fp8=true` is refused on every device with a
message saying what it needs, rather than silently training in another precision.
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


def check_fp8(enabled: bool, device: torch.device) -> None:
    """Refuse `train.fp8=true` with what it needs and what this device is."""
    if not enabled:
        return
    if device.type != "cuda":
        raise ConfigError(f"train.fp8=true is invalid on {device}: FP8 needs a CUDA GPU with FP8 tensor cores "
                          "(compute capability >= 8.9: Ada, Hopper or newer); set train.fp8=false")
    capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(f"train.fp8=true is invalid on {name} (compute capability {capability[0]}.{capability[1]}): "
                          "FP8 needs compute capability >= 8.9 (Ada, Hopper or newer); set train.fp8=false "
                          "and train.dtype=bf16")
    raise ConfigError(f"train.fp8=true: {name} has FP8 tensor cores, but FP8 linear layers are not available "
                      "in this version of Tessera; set train.fp8=false and train.dtype=bf16")
