"""An evaluation's outcome: one JSON document and a table a person reads.

    {"results": {"loss": {"loss": 2.31, "perplexity": 10.07, "tokens": 65536.0},
                 "tiny_mc": {"acc": 0.61, "acc_norm": 0.58},
                 "humaneval": {"pass@1": 0.05, "problems": 164.0}},
     "model": "runs/tiny-dense", "tasks": ["loss", "tiny_mc", "humaneval"], "config": {...},
     "seconds": 12.3, "tessera_version": "0.1.0"}

`results` maps each task to its metrics (numbers); `config` records what was asked (limit, data,
include path, few-shot, engine settings), so a result file says how it was made. `check_output`
refuses a `--output` that cannot be written before the evaluation starts; `write_output` writes it
atomically once it is done.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.config.errors import ConfigError, EvaluationError
from tessera.data.atomic_write import atomic_output, discard, temporary_sibling


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


def check_output(path: str | os.PathLike) -> Path:
    """Refuse (ConfigError, one line) a results file that cannot be written, before any evaluation:
    a directory, something other than a regular file, a parent that is a file, or a directory this
    process cannot create a file in (no permission, a read-only file system, /proc). Where the parent
    exists a file is made there and removed, the way the results will be written; else the nearest
    existing ancestor is probed, where the missing directories will be made."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"--output {str(path)!r} is a directory; give a file name")
    if out.exists() and not out.is_file():
        raise ConfigError(f"--output {str(path)!r} is not a regular file (the results are written to a new "
                          "file renamed into place); give a file name")
    ancestor = out.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"--output {str(path)!r} cannot be written: {str(ancestor)!r} is not a directory")
    try:
        probe = temporary_sibling(out) if ancestor == out.absolute().parent else temporary_sibling(ancestor / "probe")
        discard(probe)
    except OSError as e:
        raise ConfigError(f"--output {str(path)!r} cannot be written: no file can be made in {str(ancestor)!r} "
                          f"({e.strerror or e}); choose a writable place") from e
    return out


def write_output(report: EvalReport, path: str | os.PathLike) -> None:
    """The report as JSON at `path`, atomically; a failure now (a full disk) is one line."""
    try:
        with atomic_output(path) as temporary:
            temporary.write_text(report.dumps())
    except OSError as e:
        raise EvaluationError(f"the results could not be written to {str(path)!r}: {e.strerror or e} (they are "
                              "in the table above)") from e
