"""Each rank's step split into terms, from the intervals `tessera train --profile A:B` recorded
(tessera/train/run/profile_record.py), and the job's straggler.

At every instant of a step one interval is what the rank does: the innermost-most-telling one, by
priority `comm` (waiting in a collective that compute does not overlap) > `data` > `checkpoint` >
`optimizer` > `compute` (forward and backward of micro-batches) > `region` (the step engine's
forward/backward outside any micro-batch marker). Summed over the step:

    compute              forward and backward (with the host work between micro-batches)
    exposed_comm/<group> collectives of that group (dp, tp, pp, ep, cp, world) not overlapped
    pipeline_bubble      under pipeline parallelism, the forward/backward time of a stage outside
                         its micro-batches' forward and backward and its other collectives, and its
                         sends and receives to the neighbouring stages: waiting for them (with the
                         transfers and the schedule's host work)
    data_wait            reading the batch
    optimizer            gradient norm and update (less their collectives)
    checkpoint           saves
    idle                 the rest of the step: metrics, evaluation, host work outside any phase

A collective marked `overlapped` is counted apart (`overlapped_comm/<group>`), not in the step.
The straggler is the rank whose own work (its step less its exposed communication, where it waits
for the others) is largest; its lag is that work less the median of the other ranks'.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

PRIORITY = ("comm", "data", "checkpoint", "optimizer", "compute", "region")
TERMS = ("compute", "pipeline_bubble", "data_wait", "optimizer", "checkpoint", "idle")  # + exposed_comm/<group>
_TERM = {"data": "data_wait", "checkpoint": "checkpoint", "optimizer": "optimizer", "compute": "compute"}


def _label(event: dict[str, Any], pipeline: bool) -> str:
    kind = event["kind"]
    if kind == "comm":
        if pipeline and event.get("group") == "pp" and event["name"] == "send_recv":
            return "pipeline_bubble"  # a stage's send or receive waits for the neighbouring stage
        return f"exposed_comm/{event.get('group', 'world')}"
    if kind == "region":
        return "pipeline_bubble" if pipeline else "compute"
    return _TERM[kind]


def step_split(events: list[dict[str, Any]], start: float, end: float, pipeline: bool = False) -> dict[str, float]:
    """Seconds of each term in the step [start, end] from its intervals (see the module docstring)."""
    ranked = sorted((e for e in events if e["kind"] in PRIORITY and not e.get("overlapped")),
                    key=lambda e: PRIORITY.index(e["kind"]))
    cuts = sorted({start, end, *(min(max(t, start), end) for e in ranked for t in (e["t0"], e["t1"]))})
    out: dict[str, float] = defaultdict(float)
    for a, b in zip(cuts, cuts[1:], strict=False):
        middle = (a + b) / 2
        owner = next((e for e in ranked if e["t0"] <= middle < e["t1"]), None)
        out["idle" if owner is None else _label(owner, pipeline)] += b - a
    return dict(out)


def compute_by_phase(events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of forward, backward (and a zero-bubble schedule's backward weight), collectives inside included."""
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e["kind"] == "compute":
            out[e["name"]] += e["t1"] - e["t0"]
    return dict(out)


def _overlap(a: dict[str, Any], spans: list[dict[str, Any]]) -> float:
    return sum(max(0.0, min(a["t1"], s["t1"]) - max(a["t0"], s["t0"])) for s in spans
               if s["t0"] < a["t1"] and s["t1"] > a["t0"])


def _union(spans: list[dict[str, Any]]) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    for e in sorted(spans, key=lambda e: e["t0"]):
        if out and e["t0"] <= out[-1]["t1"]:
            out[-1]["t1"] = max(out[-1]["t1"], e["t1"])
        else:
            out.append({"t0": e["t0"], "t1": e["t1"]})
    return out


def compute_by_kind(events: list[dict[str, Any]], terms: dict[str, float], pipeline: bool = False) -> dict[str, float]:
    """The step's compute by kind: the `module` intervals' seconds (attention, mlp, norm, loss; at most
    one open at a time, so none counted twice) inside the step's compute (an evaluation's forward is
    not) less the exposed collectives inside them, `other` the rest of the `compute` term, and
    `optimizer` the term of that name. Empty when no module was timed."""
    modules = [e for e in events if e["kind"] == "module"]
    if not modules:
        return {}
    compute = _union([e for e in events if e["kind"] == "compute" or (e["kind"] == "region" and not pipeline)])
    waits = [e for e in events if e["kind"] == "comm" and not e.get("overlapped")]
    out: dict[str, float] = defaultdict(float)
    for e in modules:
        out[e["name"]] += max(0.0, _overlap(e, compute) - _overlap(e, waits))
    out["other"] = max(0.0, terms.get("compute", 0.0) - sum(out.values()))
    out["optimizer"] = terms.get("optimizer", 0.0)
    return dict(out)


def comm_by_kind(events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds in each group's collectives by kind ("dp/all_gather"), overlapped or not."""
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e["kind"] == "comm":
            out[f"{e.get('group', 'world')}/{e['name']}"] += e["t1"] - e["t0"]
    return dict(out)


def overlapped_comm(events: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e["kind"] == "comm" and e.get("overlapped"):
            out[f"overlapped_comm/{e.get('group', 'world')}"] += e["t1"] - e["t0"]
    return dict(out)


def rank_steps(events: list[dict[str, Any]], pipeline: bool = False) -> dict[int, dict[str, Any]]:
    """Step -> {"step_s", "terms", "compute_by_kind", "compute_by_phase", "comm_by_kind", "overlapped"}
    of one rank's events."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_step[e["step"]].append(e)
    out = {}
    for step, items in sorted(by_step.items()):
        whole = next((e for e in items if e["kind"] == "step"), None)
        if whole is None:  # a step the run did not finish
            continue
        terms = step_split(items, whole["t0"], whole["t1"], pipeline)
        out[step] = {"step_s": whole["t1"] - whole["t0"], "terms": terms,
                     "compute_by_kind": compute_by_kind(items, terms, pipeline),
                     "compute_by_phase": compute_by_phase(items),
                     "comm_by_kind": comm_by_kind(items),
                     "overlapped": overlapped_comm(items)}
    return out


def mean_terms(steps: dict[int, dict[str, Any]], key: str = "terms") -> dict[str, float]:
    """Each term's seconds per step, averaged over the steps."""
    total: dict[str, float] = defaultdict(float)
    for s in steps.values():
        for name, seconds in s[key].items():
            total[name] += seconds
    return {name: seconds / max(len(steps), 1) for name, seconds in sorted(total.items())}


def own_work(terms: dict[str, float], step_s: float) -> float:
    """A rank's own work in a step: what is left when its waits in collectives are taken out."""
    return step_s - sum(v for k, v in terms.items() if k.startswith("exposed_comm/"))


def straggler(ranks: dict[int, dict[str, Any]], threshold: float = 0.05) -> dict[str, Any]:
    """The rank with the most own work, its lag over the other ranks' median (seconds per step) and
    whether the lag exceeds `threshold` x the median step (`named`)."""
    own = {r: own_work(v["terms"], v["step_s"]) for r, v in ranks.items()}
    if len(own) < 2:
        return {"rank": None, "lag_s": 0.0, "named": False, "own_work_s": own}
    rank = max(own, key=own.__getitem__)
    lag = own[rank] - statistics.median(v for r, v in own.items() if r != rank)
    median_step = statistics.median(v["step_s"] for v in ranks.values())
    return {"rank": rank, "lag_s": lag, "lag_fraction": lag / median_step if median_step > 0 else 0.0,
            "named": lag > threshold * median_step, "own_work_s": {str(r): v for r, v in own.items()}}
