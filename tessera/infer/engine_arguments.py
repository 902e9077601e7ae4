"""The engine options whose command-line text is more than one number (`EngineConfig`'s flags):
argparse converters for batch-size buckets and per-modality limits, and `NAME=DIR` adapters."""

from __future__ import annotations

import argparse
import json

from tessera.config.errors import ConfigError

MODALITIES = ("image",)  # what a request may carry besides text


def batch_sizes(text: str) -> list[int]:
    """`--decode-batch-sizes`: comma-separated positive integers, or 'none' (the empty list)."""
    if text.strip().lower() == "none":
        return []
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 or b > 4096 for b in sizes):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers in 1..4096 or 'none', got {text!r}")
    return sizes


def mm_limits(text: str) -> dict[str, int]:
    """`image=2[,...]` or a JSON object {"image": 2}, as vLLM's --limit-mm-per-prompt takes."""
    text = text.strip()
    try:
        if text.startswith("{"):
            value = json.loads(text)
        else:
            value = {k.strip(): int(v) for k, _, v in (item.partition("=") for item in text.split(",") if item)}
    except ValueError:
        value = None
    if (not isinstance(value, dict) or not set(value) <= set(MODALITIES)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values())):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: modality=count (image=2) or a JSON object "
                                         f"{{\"image\": 2}}; modalities: {', '.join(MODALITIES)}; counts >= 0")
    return value


def named_adapters(items: list[str]) -> dict[str, str]:
    """`--lora NAME=DIR ...` as {name: directory}; ConfigError for an item that is not NAME=DIR."""
    adapters = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {item!r} is invalid: expected NAME=DIR")
        adapters[name] = path
    return adapters
