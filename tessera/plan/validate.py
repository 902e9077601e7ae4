"""`tessera plan validate [--json]`: the time model against every published run.

For each run of tessera/plan/published.py: the published figure, the prediction, the relative
error (predicted / published - 1) and the step-time terms behind the prediction, so a reader
sees where the time goes. JSON: a list of objects with `name`, `published`, `predicted`,
`relative_error` (plus `metric`, `unit`, `source`, `gpu`, `gpus`, `layout`, `terms`).
"""

from __future__ import annotations

import json

from tessera.plan.published import METRICS, plan_run, predicted_figure, published_runs
from tessera.plan.search import time_components


def validation_rows() -> list[dict]:
    rows = []
    for run in published_runs():
        plan = plan_run(run)
        predicted = predicted_figure(run, plan)
        rows.append({"name": run.name, "published": run.figure, "predicted": predicted,
                     "relative_error": predicted / run.figure - 1.0, "metric": run.metric,
                     "unit": METRICS[run.metric], "source": run.source, "gpu": run.gpu, "gpus": run.gpus,
                     "layout": run.layout.describe(), "mfu": plan.mfu, "fits": plan.fits,
                     "terms": time_components(plan), "step_seconds": plan.time.total})
    return rows


def render_validation(rows: list[dict]) -> str:
    width = max(len(r["name"]) for r in rows)
    out = [f"{'run':<{width}}  {'published':>10}  {'predicted':>10}  {'error':>7}  unit          MFU",
           "-" * (width + 52)]
    for r in rows:
        out.append(f"{r['name']:<{width}}  {r['published']:>10.2f}  {r['predicted']:>10.2f}  "
                   f"{100 * r['relative_error']:>+6.1f}%  {r['unit']:<12}  {100 * r['mfu']:.1f}%")
    worst = max(rows, key=lambda r: abs(r["relative_error"]))
    out += ["", f"Largest error {100 * abs(worst['relative_error']):.1f}% ({worst['name']}).", "",
            "Where the predicted step time goes (seconds):"]
    for r in rows:
        terms = ", ".join(f"{k} {v:.3g}" for k, v in r["terms"].items())
        out.append(f"  {r['name']}: {r['layout']}; {terms}")
    out += ["", "Sources:"] + sorted({f"  {r['source']}" for r in rows})
    return "\n".join(out)


def run_validation(as_json: bool) -> int:
    rows = validation_rows()
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(render_validation(rows))
    return 0
