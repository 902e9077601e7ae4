"""Where per-step metrics go: `run_dir/metrics.jsonl` (one JSON object per logged step) and
TensorBoard events under `run_dir/tensorboard`.

On resume, lines of steps after the checkpoint are dropped first: those steps are trained again,
and the file should read as one run, each step once (a restarted job resumes the same way). A run
that rolls back to a checkpoint while it trains (the loss-spike rule) drops them with `rewind`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from tessera.config.json_text import read_json_lines

METRICS_FILE = "metrics.jsonl"


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)  # JSON has no NaN/Infinity
    return v


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of `run_dir/metrics.jsonl` (an incomplete last line, from a kill, is skipped)."""
    return read_json_lines(Path(run_dir) / METRICS_FILE)


class MetricsWriter:
    """Appends metric records; numeric values also go to TensorBoard as scalars."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            self._drop_after(resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def _drop_after(self, step: int) -> None:
        kept = [r for r in read_metrics(self.run_dir) if int(r.get("step", 0)) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def rewind(self, step: int) -> None:
        """Drop the lines of steps after `step` (they are trained again, on other batches)."""
        self._file.close()
        self._drop_after(step)
        self._file = open(self.path, "a")

    def write(self, record: dict[str, Any]) -> None:
        """One line in metrics.jsonl (flushed at once) and a scalar per number in TensorBoard."""
        clean = {k: _json_value(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
