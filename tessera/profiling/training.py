"""`tessera profile RUN_DIR` on a training run: read run_dir/profile/rank<R>.jsonl, split each rank's
steps (split.py), name the straggler, put the planner's prediction beside each term (planned.py)
and say it in a few lines.

The report (`analyse`), seconds per step averaged over the profiled steps:

    {"steps": [20, 21, ...], "world": W, "ranks": {"0": {"step_s", "terms", "compute_by_kind",
     "compute_by_phase", "comm_by_kind", "overlapped", "steps": {"20": {"step_s", "terms"}}}, ...},
     "job": {"step_s", "mfu"}, "terms": {name: {"measured_s", "planned_s"}},
     "compute_by_kind": {kind: {"measured_s", "planned_s"}} (attention, mlp, norm, loss, other, optimizer),
     "differences": [{"term", "measured_s", "planned_s", "difference_s"}, ...] (largest first),
     "straggler": {"rank", "lag_s", "lag_fraction", "named", "own_work_s"}, "planned": {...}}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera.config.errors import ConfigError, TesseraError
from tessera.profiling.split import mean_terms, rank_steps, straggler

PROFILE_DIR = "profile"
TOP_DIFFERENCES = 3


def read_profile(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Rank -> {"meta", "events"} of every rank file under run_dir/profile."""
    files = sorted((Path(run_dir) / PROFILE_DIR).glob("rank*.jsonl"))
    if not files:
        raise ConfigError(f"RUN_DIR={str(run_dir)!r} is invalid: it holds no profile/rank*.jsonl; record one "
                          "with `tessera train CONFIG --profile A:B` (run_dir of that config)")
    out = {}
    for path in files:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not lines or "meta" not in lines[0]:
            raise ConfigError(f"{path.name} is invalid: its first line must be the profile's meta line")
        meta = lines[0]["meta"]
        out[int(meta["rank"])] = {"meta": meta, "events": lines[1:]}
    return out


def _rank_report(data: dict[str, Any]) -> dict[str, Any]:
    steps = rank_steps(data["events"], data["meta"]["sizes"].get("pp", 1) > 1)
    step_s = sum(s["step_s"] for s in steps.values()) / max(len(steps), 1)
    return {"step_s": step_s, "terms": mean_terms(steps), "compute_by_kind": mean_terms(steps, "compute_by_kind"),
            "compute_by_phase": mean_terms(steps, "compute_by_phase"),
            "comm_by_kind": mean_terms(steps, "comm_by_kind"), "overlapped": mean_terms(steps, "overlapped"),
            "steps": {str(k): {"step_s": v["step_s"], "terms": v["terms"]} for k, v in steps.items()}}


def _job_terms(ranks: dict[int, dict[str, Any]], key: str = "terms") -> dict[str, float]:
    """Each term (of `key`) averaged over ranks (a term a rank lacks counts 0 there)."""
    names = sorted({n for r in ranks.values() for n in r[key]})
    return {n: sum(r[key].get(n, 0.0) for r in ranks.values()) / len(ranks) for n in names}


def _planned(run_dir: Path, world: int, compute_s: float) -> dict[str, Any]:
    from tessera.profiling.planned import planned_terms

    try:
        return planned_terms(run_dir, world, compute_s)
    except (TesseraError, OSError) as e:  # the report stands without the plan; it says why
        return {"terms": {}, "hardware": None, "error": f"{type(e).__name__}: {e}"}


_ORDER = ("compute", "pipeline_bubble", "exposed_comm/", "data_wait", "optimizer", "checkpoint", "idle")


def _order(term: str) -> tuple[int, str]:
    """The waterfall's order: from compute to the measured step."""
    return next((i for i, p in enumerate(_ORDER) if term == p or (p.endswith("/") and term.startswith(p))),
                len(_ORDER)), term


KIND_ORDER = ("attention", "mlp", "norm", "loss", "other", "optimizer")


def _by_kind(ranks: dict[int, dict[str, Any]], planned: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """The job's compute by kind (averaged over ranks) beside the plan's, where it has one."""
    measured = _job_terms(ranks, "compute_by_kind")
    plan = planned.get("compute_by_kind", {})
    names = sorted(measured, key=lambda k: (KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER), k))
    return {k: {"measured_s": measured[k], "planned_s": plan.get(k)} for k in names}


def analyse(run_dir: Path | str, plan: bool = True) -> dict[str, Any]:
    """The report of a profiled training run (the module docstring); `plan=False` leaves the planner out."""
    run_dir = Path(run_dir)
    profile = read_profile(run_dir)
    meta = profile[min(profile)]["meta"]
    ranks = {r: _rank_report(d) for r, d in sorted(profile.items())}
    measured = _job_terms(ranks)
    step_s = sum(r["step_s"] for r in ranks.values()) / len(ranks)
    # the plan's compute is the slowest pipeline stage's: under pp the rates are scaled to that rank's
    pipelined = meta["sizes"].get("pp", 1) > 1
    compute = max(r["terms"].get("compute", 0.0) for r in ranks.values()) if pipelined else measured.get("compute", 0.0)
    planned = _planned(run_dir, meta["world"], compute) if plan else {"terms": {}}
    names = sorted(set(measured) | set(planned["terms"]), key=_order)
    unplanned = 0.0 if planned["terms"] else None  # a term the plan has no line for, it predicts none of
    terms = {n: {"measured_s": measured.get(n, 0.0), "planned_s": planned["terms"].get(n, unplanned)} for n in names}
    notes = []
    differences = sorted(({"term": n, **v, "difference_s": v["measured_s"] - v["planned_s"]}
                          for n, v in terms.items() if v["planned_s"] is not None and v["measured_s"] is not None),
                         key=lambda d: -abs(d["difference_s"]))[:TOP_DIFFERENCES]
    flops = meta.get("flops_per_token", 0.0) * meta.get("tokens_per_step", 0)
    peak = meta.get("peak_flops")
    steps = sorted({int(s) for r in ranks.values() for s in r["steps"]})
    return {"steps": steps, "world": meta["world"], "sizes": meta["sizes"], "device": meta.get("device"),
            "ranks": {str(r): v for r, v in ranks.items()},
            "job": {"step_s": step_s, "model_flops_per_step": flops,
                    "mfu": flops / (step_s * peak * meta["world"]) if peak and step_s > 0 else None},
            "terms": terms, "compute_by_kind": _by_kind(ranks, planned), "differences": differences,
            "straggler": straggler(ranks), "planned": planned,
            "notes": notes}


def summary(report: dict[str, Any]) -> str:
    """The report in a few lines: the step, its terms beside the plan, the differences, the straggler."""
    job, steps = report["job"], report["steps"]
    lines = [f"steps {steps[0]}..{steps[-1]} on {report['world']} rank(s): {job['step_s']:.3f} s per step"
             + (f", MFU {job['mfu']:.1%}" if job["mfu"] is not None else "")]
    lines.append(f"  {'term':28s} {'measured s':>11s} {'planned s':>10s}")
    for name, v in report["terms"].items():
        planned = "-" if v["planned_s"] is None else f"{v['planned_s']:.4f}"
        measured = "-" if v["measured_s"] is None else f"{v['measured_s']:.4f}"
        lines.append(f"  {name:28s} {measured:>11s} {planned:>10s}")
    if report["compute_by_kind"]:
        lines.append("compute by kind: " + ", ".join(
            f"{k} {v['measured_s']:.4f} s" + ("" if v["planned_s"] is None else f" (plan {v['planned_s']:.4f})")
            for k, v in report["compute_by_kind"].items()))
    if report["differences"]:
        lines.append("largest differences from the plan: " + "; ".join(
            f"{d['term']} {d['difference_s']:+.3f} s" for d in report["differences"]))
    if "error" in report["planned"]:
        lines.append(f"no plan: {report['planned']['error']}")
    lines += [f"note: {n}" for n in report["notes"]]
    s = report["straggler"]
    if s["rank"] is not None:
        verdict = "the straggler" if s["named"] else "the slowest, within noise"
        lines.append(f"rank {s['rank']} is {verdict}: {s['lag_s']:.3f} s per step ({s['lag_fraction']:.0%}) more own "
                     "work than the other ranks' median")
    return "\n".join(lines)
