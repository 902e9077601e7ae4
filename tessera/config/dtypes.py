"""The floating-point dtypes Tessera computes in, and their two spellings: torch's names (float32,
bfloat16, float16: `tessera serve --dtype`, `EngineConfig.dtype`, HuggingFace's `torch_dtype`) and
the short ones of `train.dtype` (fp32, bf16, fp16). One table, so that either spelling is accepted
wherever a dtype is; each place keeps the spelling it stores (serving torch's, training the short one).
"""

from __future__ import annotations

from tessera.config.errors import ConfigError

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch's name -> train.dtype's
_LONG = {**{name: name for name in DTYPES}, **{short: name for name, short in DTYPES.items()}}


def _allowed(short: bool) -> str:
    first, second = (DTYPES.values(), DTYPES) if short else (DTYPES, DTYPES.values())
    return f"one of {', '.join(first)} (or {', '.join(second)})"


def dtype_name(name: str, key: str = "dtype") -> str:
    """torch's name of the dtype `name` spells either way (`bf16` -> `bfloat16`); ConfigError naming
    `key` for any other name."""
    if name not in _LONG:
        raise ConfigError(f"{key}={name!r} is invalid: {_allowed(short=False)}")
    return _LONG[name]


def short_dtype_name(name: str, key: str = "train.dtype") -> str:
    """train.dtype's name of the dtype `name` spells either way (`bfloat16` -> `bf16`)."""
    if name not in _LONG:
        raise ConfigError(f"{key}={name!r} is invalid: {_allowed(short=True)}")
    return DTYPES[_LONG[name]]


def dtype_argument(name: str) -> str:
    """An argparse `type=` for a --dtype option with torch's names as its `choices`: either spelling
    becomes torch's name, anything else stays as given for argparse to refuse naming the choices."""
    return _LONG.get(name, name)


def short_dtype_argument(name: str) -> str:
    """The same for an option whose choices are train.dtype's short names (`tessera convert --dtype`)."""
    return DTYPES.get(_LONG.get(name, ""), name)


def torch_dtype(name: str):
    """The torch dtype `name` spells either way (torch is imported here, not with the module: `tessera
    --help` and the planner read this file without torch)."""
    import torch

    return getattr(torch, dtype_name(name))
