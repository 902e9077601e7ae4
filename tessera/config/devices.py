"""Where a command computes: the names `train.device` and `tessera serve --device` take (auto, cpu,
cuda, cuda:N), resolved by one function for both."""

from __future__ import annotations

from tessera.config.errors import ConfigError

DEVICE_NAMES = "auto, cpu, cuda, cuda:N"


def resolve_device(name: str, local_rank: int | None = None, key: str = "device") -> str:
    """The device `name` asks for, as torch spells it: `auto` is the GPU when there is one, else the
    CPU; on one of several local ranks (`local_rank`) `auto` and `cuda` mean that rank's GPU.
    ConfigError naming `key` for another name, or a GPU this machine does not have. torch is imported
    here, not with the module (`tessera serve --help` reads this file without it)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"{key}={name!r} is invalid: one of {DEVICE_NAMES}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name!r} is invalid: CUDA is not available here; use cpu or auto")
    if name == "cuda" and local_rank is not None:
        name = f"cuda:{local_rank}"
    return name
