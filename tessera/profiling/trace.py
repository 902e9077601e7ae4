"""The ranks' recorded intervals as one Chrome trace (`chrome://tracing`, ui.perfetto.dev): a process
per rank, a thread per kind of interval, times in microseconds from the first interval of the job."""

from __future__ import annotations

from typing import Any

KIND_THREADS = ("step", "data", "compute", "region", "module", "comm", "optimizer", "checkpoint", "sync")


def chrome_trace(profile: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """{"traceEvents": [...]} of every rank's events (`training.read_profile`'s result)."""
    start = min((e["t0"] for d in profile.values() for e in d["events"]), default=0.0)
    events: list[dict[str, Any]] = []
    for rank, data in sorted(profile.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, kind in enumerate(KIND_THREADS):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": kind}})
        for e in data["events"]:
            tid = KIND_THREADS.index(e["kind"]) if e["kind"] in KIND_THREADS else len(KIND_THREADS)
            name = e["name"] if e["kind"] != "comm" else f"{e['name']} [{e.get('group', 'world')}]"
            name += f" mb{e['microbatch']}" if e.get("microbatch") is not None else ""
            args = {k: v for k, v in e.items() if k not in ("t0", "t1", "name", "kind")}
            events.append({"ph": "X", "name": name, "cat": e["kind"], "pid": rank, "tid": tid,
                           "ts": (e["t0"] - start) * 1e6, "dur": (e["t1"] - e["t0"]) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
