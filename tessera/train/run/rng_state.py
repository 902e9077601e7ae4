"""Capture and restore every random number generator a training step can touch.

A resumed run must draw the same random numbers as an uninterrupted one (router jitter, dropout,
sampling), so the checkpoint holds the states of Python's `random`, NumPy's global generator and
torch's CPU and CUDA generators, as JSON (`encode_rng_state`), never as a pickle.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def encode_rng_state(state: dict[str, Any]) -> dict[str, Any]:
    """`capture_rng_state()` as JSON-able data (checkpoints hold no pickles): lists of ints, byte
    tensors as base64."""
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    out = {"python": [version, list(internal), gauss],
           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
           "torch": _b64(state["torch"])}
    if "cuda" in state:
        out["cuda"] = [_b64(t) for t in state["cuda"]]
    return out


def decode_rng_state(data: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `encode_rng_state`; ValueError if `data` is not what it writes."""
    try:
        version, internal, gauss = data["python"]
        name, keys, pos, has_gauss, cached = data["numpy"]
        state = {"python": (int(version), tuple(int(x) for x in internal), gauss),
                 "numpy": (str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)),
                 "torch": _from_b64(data["torch"])}
        if "cuda" in data:
            state["cuda"] = [_from_b64(x) for x in data["cuda"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed RNG state ({type(e).__name__}: {e})") from e
    return state


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)
