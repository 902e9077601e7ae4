"""What the agent-parser tests share: deterministic call ids, the ways of cutting a text into deltas,
and a stream's deltas put back together as a client does (content appended; a call's id and name
from its first delta, its arguments the concatenation of its fragments)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator


def numbered_ids(prefix: str = "call_"):
    """Ids call_0, call_1, ...: a stream and a whole parse given one each name the same call alike."""
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


def cuts(text: str, seed: int = 0, random_cuts: int = 20, every_position: bool = True) -> Iterator[list[str]]:
    """The text as deltas: cut in two at every position (an empty first or last piece included; unless
    not `every_position`), one character at a time, and `random_cuts` times at several random positions
    at once."""
    for k in range(len(text) + 1 if every_position else 0):
        yield [text[:k], text[k:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(random_cuts):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 12))))
        yield [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def joined_calls(deltas) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call from OpenAI-shaped deltas, checking their shape: a call's
    first delta has its id and name and no arguments, the next ones arguments only, indices in order."""
    calls: list[list[str]] = []
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls) and d.name and d.arguments == "", d
            calls.append([d.id, d.name, ""])
        else:
            assert d.index == len(calls) - 1 and d.name is None, d
            calls[d.index][2] += d.arguments
    return [tuple(c) for c in calls]
