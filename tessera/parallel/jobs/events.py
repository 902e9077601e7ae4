"""What happened to a run, beyond its metrics: `run_dir/events.jsonl`, one JSON object per event.

    {"event": "restart", "time": 1718000000.0, "restart": 1, "max_restarts": 3, "rank": 2, ...}

Events are the job's history: restarts and their causes (written by the launcher between attempts,
tessera.parallel.jobs.launch), steps skipped for a gradient that was not finite, loss spikes and the
roll-backs they caused, stragglers (written by rank 0 of the trainer). Unlike metrics.jsonl, which
a resumed run rewrites so that it holds each step once, events are never dropped: a step trained
twice after a restart has its first attempt's events too. Each event is also one line on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.config.json_text import read_json_lines

EVENTS_FILE = "events.jsonl"


def append_event(run_dir: str | os.PathLike, event: str, fields: dict[str, Any], message: str,
                 say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Append `{"event": event, "time": now, **fields}` to run_dir/events.jsonl (flushed and synced, so
    that a kill right after leaves it whole) and print `message` on stderr (or hand it to `say`, e.g.
    a progress bar's own writer); returns the record."""
    record = {"event": event, "time": round(time.time(), 3), **fields}
    path = Path(run_dir) / EVENTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if say is not None:
        say(message)
    else:
        print(message, file=sys.stderr, flush=True)
    return record


def read_events(run_dir: str | os.PathLike, event: str | None = None) -> list[dict[str, Any]]:
    """The events of run_dir (those named `event` only, when given); a line cut short by a kill is skipped."""
    return [record for record in read_json_lines(Path(run_dir) / EVENTS_FILE)
            if isinstance(record, dict) and (event is None or record.get("event") == event)]
