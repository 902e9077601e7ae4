"""`tessera plan validate [--json]`: the planner against every published run, time and memory.

For each run of tessera/plan/published.py: whether it is a calibration run (the time constants were
chosen with it in view) or held out; the published figure, the prediction, the relative error
(predicted / published - 1; None where the source's kernels are ones the time model does not price,
with the reason in `time_not_compared`) and the step-time terms behind the prediction; and memory: the planned
peak of the busiest rank against the published per-GPU memory where the source gives one, and
against the memory of the GPUs it ran on (it must fit). The held-out errors are the ones to quote.
JSON: a list of objects with `name`, `published`, `predicted`, `relative_error`, `held_out`,
`time_not_compared`, `lowest_peak_relative_error` (the error at the lowest GPU peak the source
allows, where it gives only a range) (plus `metric`, `unit`, `source`, `gpu`, `gpus`, `layout`,
`terms`, `predicted_tessera_profile`) and `memory` (`published_gib`, `ran_on_gib`, `predicted_gib`,
`relative_error`, `fits`, `layout`).
"""

from __future__ import annotations

import json

from tessera.plan.published import METRICS, PublishedRun, plan_run, predicted_figure, published_runs
from tessera.plan.search import time_components

GiB = 2**30


def _memory_row(run: PublishedRun) -> dict:
    plan = plan_run(run, memory=True)
    predicted = plan.peak.total / GiB
    published = run.memory_gib
    return {"published_gib": published, "ran_on_gib": plan.cluster.gpu_memory / GiB, "predicted_gib": predicted,
            "usable_gib": plan.cluster.usable_memory / GiB, "fits": plan.fits, "layout": plan.layout.describe(),
            "relative_error": None if published is None else predicted / published - 1.0}


def validation_rows() -> list[dict]:
    rows = []
    for run in published_runs():
        plan = plan_run(run)
        predicted = predicted_figure(run, plan)
        compared = run.time_not_compared is None
        low = predicted_figure(run, plan_run(run, lowest_peak=True)) if run.lowest_peak is not None else None
        rows.append({"name": run.name, "published": run.figure, "predicted": predicted,
                     "relative_error": predicted / run.figure - 1.0 if compared else None,
                     "time_not_compared": run.time_not_compared, "held_out": run.held_out, "metric": run.metric,
                     "lowest_peak_relative_error": low / run.figure - 1.0 if compared and low is not None else None,
                     "unit": METRICS[run.metric], "source": run.source, "gpu": run.gpu, "gpus": run.gpus,
                     "layout": run.layout.describe(), "mfu": plan.mfu, "profile": run.profile,
                     "predicted_tessera_profile": predicted_figure(run, plan_run(run, "tessera")),
                     "terms": time_components(plan), "step_seconds": plan.time.total, "memory": _memory_row(run)})
    return rows


def _worst(rows: list[dict], error) -> str:
    rated = [r for r in rows if error(r) is not None]
    if not rated:
        return "none"
    worst = max(rated, key=lambda r: abs(error(r)))
    return f"{100 * abs(error(worst)):.1f}% ({worst['name']})"


def summary(rows: list[dict]) -> list[str]:
    """The lines to quote: calibration and held-out errors apart, and the memory check."""
    calibration = [r for r in rows if not r["held_out"]]
    held_out = [r for r in rows if r["held_out"]]
    fits = sum(r["memory"]["fits"] for r in rows)
    timed = [r for r in held_out if r["relative_error"] is not None]
    with_memory = [r for r in rows if r["memory"]["relative_error"] is not None]
    bracketed = [r for r in timed if r["lowest_peak_relative_error"] is not None]
    at_lowest = (f", {_worst(bracketed, lambda r: r['lowest_peak_relative_error'])} at the lowest peak its "
                 "source allows" if bracketed else "")
    return [f"Calibration runs (time constants chosen with them in view): largest time error "
            f"{_worst(calibration, lambda r: r['relative_error'])}.",
            f"Held-out runs: largest time error {_worst(held_out, lambda r: r['relative_error'])}{at_lowest} "
            f"({len(timed)} runs timed); largest memory error "
            f"{_worst(rows, lambda r: r['memory']['relative_error'])} ({len(with_memory)} runs with a published "
            "per-GPU memory; no memory constant is fitted to any run).",
            f"{fits} of {len(rows)} runs fit the memory of the GPUs they ran on."]


def render_validation(rows: list[dict]) -> str:
    width = max(len(r["name"]) for r in rows)
    out = ["Time", f"{'run':<{width}}  {'set':<11}  {'published':>10}  {'predicted':>10}  {'error':>7}  unit"
           "          MFU", "-" * (width + 66)]
    for r in rows:
        kind = "held out" if r["held_out"] else "calibration"
        error = "  n/c" if r["relative_error"] is None else f"{100 * r['relative_error']:>+6.1f}%"
        out.append(f"{r['name']:<{width}}  {kind:<11}  {r['published']:>10.2f}  {r['predicted']:>10.2f}  "
                   f"{error:>7}  {r['unit']:<12}  {100 * r['mfu']:.1f}%")
    not_compared = sorted({r["time_not_compared"] for r in rows if r["time_not_compared"]})
    out += [f"n/c: time not compared, {why}" for why in not_compared]
    out += [f"{r['name']}: {100 * r['lowest_peak_relative_error']:+.1f}% at the lowest peak its source allows"
            for r in rows if r["lowest_peak_relative_error"] is not None]
    out += ["", "Memory per GPU (GiB): the busiest rank's planned peak against the published figure, and against "
            "the GPUs it ran on (usable: less the 3 GiB reserve)",
            f"{'run':<{width}}  {'published':>9}  {'ran on':>6}  {'predicted':>9}  {'error':>7}  fits",
            "-" * (width + 50)]
    for r in rows:
        m = r["memory"]
        published = "-" if m["published_gib"] is None else f"{m['published_gib']:.1f}"
        error = "-" if m["relative_error"] is None else f"{100 * m['relative_error']:+.1f}%"
        out.append(f"{r['name']:<{width}}  {published:>9}  {m['ran_on_gib']:>6.0f}  {m['predicted_gib']:>9.1f}  "
                   f"{error:>7}  {'yes' if m['fits'] else 'NO'}")
    out += [""] + summary(rows)
    out += ["", "Where the predicted step time goes (seconds):"]
    for r in rows:
        terms = ", ".join(f"{k} {v:.3g}" for k, v in r["terms"].items())
        out.append(f"  {r['name']}: {r['layout']}; {terms}")
    differing = [r for r in rows if r["memory"]["layout"] != r["layout"]]
    if differing:
        out += ["", "Memory planned with the source's memory policies:"]
        out += [f"  {r['name']}: {r['memory']['layout']}" for r in differing]
    out += ["", "Sources:"] + sorted({f"  {r['source']}" for r in rows})
    return "\n".join(out)


def run_validation(as_json: bool) -> int:
    rows = validation_rows()
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(render_validation(rows))
    return 0
