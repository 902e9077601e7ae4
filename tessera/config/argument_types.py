"""Command-line numbers checked while the arguments are parsed, and a parser whose errors are one line.

Each function here is an argparse `type=`: it turns the text into a number or raises
`argparse.ArgumentTypeError` saying what is allowed, so `tessera generate --temperature nan`
ends with one line and exit status 2 (`tessera generate: error: argument --temperature: ...`)
before any model is loaded, instead of a traceback from the sampler. The ranges are the same as
the configuration's (`tessera.config.limits`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from tessera.config.errors import ConfigError
from tessera.config.json_text import check_text
from tessera.config.limits import MAX_PORT, MAX_SEED, MIN_TEMPERATURE


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are the CLI's one-line form, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _parse(text: str, kind: type, allowed: str) -> int | float:
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{allowed}, got {text!r}") from None


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An integer in low..high."""
    allowed = f"must be an integer in {low}..{high}"

    def parse(text: str) -> int:
        value = _parse(text, int, allowed)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{allowed}, got {text!r}")
        return value

    return parse


def positive_float(high: float = math.inf) -> Callable[[str], float]:
    """A finite number in (0, high]."""
    return _finite_float(high, zero_allowed=False)


def nonnegative_float(high: float = math.inf) -> Callable[[str], float]:
    """A finite number in [0, high]."""
    return _finite_float(high, zero_allowed=True)


def _finite_float(high: float, *, zero_allowed: bool) -> Callable[[str], float]:
    """A finite number > 0 (or >= 0 where `zero_allowed`) and <= high."""
    allowed = f"must be a finite number {'>=' if zero_allowed else '>'} 0" + (
        f" and <= {high:,.0f}" if math.isfinite(high) else "")

    def parse(text: str) -> float:
        value = _parse(text, float, allowed)
        if not (math.isfinite(value) and (0 <= value if zero_allowed else 0 < value) and value <= high):
            raise argparse.ArgumentTypeError(f"{allowed}, got {text!r}")
        return value

    return parse


def temperature(text: str) -> float:
    """0 (greedy) or a finite number >= MIN_TEMPERATURE: below it logits / T overflows fp32 to inf."""
    allowed = f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}"
    value = _parse(text, float, allowed)
    if not (value == 0 or (math.isfinite(value) and value >= MIN_TEMPERATURE)):
        raise argparse.ArgumentTypeError(f"{allowed}, got {text!r}")
    return value


def top_p(text: str) -> float:
    """Nucleus mass in (0, 1]."""
    allowed = "must be a number in (0, 1]"
    value = _parse(text, float, allowed)
    if not 0 < value <= 1:  # also false for NaN
        raise argparse.ArgumentTypeError(f"{allowed}, got {text!r}")
    return value


top_k = int_in(0, 2**31 - 1)  # 0 = no limit (HuggingFace's convention); more than the vocabulary is no limit too
seed = int_in(0, MAX_SEED)
port = int_in(0, MAX_PORT)  # 0 = a free port chosen by the operating system


def text(value: str) -> str:
    """Text a model reads or a response carries (a prompt, a name): Unicode text. Bytes the OS
    cannot decode reach Python as lone surrogates, which no tokenizer or JSON output takes (paths
    keep them: the file system gives them back as the same bytes)."""
    try:
        return check_text(value, "the value", ConfigError)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
