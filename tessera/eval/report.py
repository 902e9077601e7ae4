"""An evaluation's outcome: one JSON document and a table a person reads.

    {"results": {"loss": {"loss": 2.31, "perplexity": 10.07, "tokens": 65536.0},
                 "tiny_mc": {"acc": 0.61, "acc_norm": 0.58},
                 "humaneval": {"pass@1": 0.05, "problems": 164.0}},
     "model": "runs/tiny-dense", "tasks": ["loss", "tiny_mc", "humaneval"], "config": {...},
     "seconds": 12.3, "tessera_version": "0.1.0"}

`results` maps each task to its metrics (numbers); `config` records what was asked (limit, data,
include path, few-shot, engine settings), so a result file says how it was made.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EvalReport:
    model: str
    tasks: list[str]
    results: dict[str, dict[str, float]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"results": {t: {m: _json_number(v) for m, v in ms.items()} for t, ms in self.results.items()},
                "model": self.model, "tasks": list(self.tasks), "config": self.config,
                "seconds": round(self.seconds, 3), "tessera_version": _version()}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"

    def table(self) -> str:
        """task | metric | value, one metric a line, in the order the tasks were asked for."""
        rows = [(task, metric, _format(value)) for task, metrics in self.results.items()
                for metric, value in metrics.items()]
        header = ("task", "metric", "value")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        line = lambda r: f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}"  # noqa: E731
        return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def _format(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4f}"


def _json_number(value: float) -> float | str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tessera")
    except PackageNotFoundError:
        return "unknown"
