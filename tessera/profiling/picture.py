"""The report's picture as a list of coloured rectangles with labels, drawn by html_report.py (SVG) and
png.py (pixels) alike:

- a timeline per rank over the profiled steps: each instant in the colour of what the rank did then
  (the split's priority: a collective over data over a checkpoint over the optimizer over compute);
- a waterfall of the job's step: compute first, then each other term added, to the measured step
  time, with the plan's prediction of each term as a thin bar beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.profiling.split import PRIORITY

WIDTH = 900
LEFT = 170  # room for the labels
ROW = 22
COLOURS = {"compute": "#4e79a7", "region": "#9cb3d4", "pipeline_bubble": "#f28e2b", "comm": "#e15759",
           "exposed_comm": "#e15759", "data": "#76b7b2", "data_wait": "#76b7b2", "optimizer": "#59a14f",
           "checkpoint": "#edc948", "idle": "#d3cfcb", "step": "#d3cfcb", "planned": "#333333"}
# compute by kind: the waterfall's rows under `compute` (shades of compute's blue; optimizer its own)
KIND_COLOURS = {"attention": "#2f5d8a", "mlp": "#6a9fd4", "norm": "#a9c6e8", "loss": "#3d7fbf", "other": "#c8d6e5"}


@dataclass
class Box:
    x: float
    y: float
    w: float
    h: float
    colour: str
    title: str = ""  # hover text (SVG)


@dataclass
class Text:
    x: float
    y: float
    text: str


@dataclass
class Scene:
    width: int
    height: int
    boxes: list[Box]
    texts: list[Text]


def _colour(term: str) -> str:
    return COLOURS.get(term.split("/")[0], "#999999")


def _timeline(profile: dict[int, dict[str, Any]], top: float, boxes: list[Box], texts: list[Text]) -> float:
    events = [e for d in profile.values() for e in d["events"]]
    start = min((e["t0"] for e in events), default=0.0)
    end = max((e["t1"] for e in events), default=1.0)
    scale = (WIDTH - LEFT - 10) / max(end - start, 1e-9)
    texts.append(Text(10, top + 14, f"timeline, {end - start:.3f} s"))
    top += ROW
    order = ["step", *reversed(PRIORITY)]  # lowest priority drawn first, the telling ones on top
    for rank, data in sorted(profile.items()):
        pipeline = data["meta"]["sizes"].get("pp", 1) > 1
        texts.append(Text(10, top + 15, f"rank {rank}"))
        for kind in order:
            for e in (e for e in data["events"] if e["kind"] == kind and not e.get("overlapped")):
                colour = COLOURS["pipeline_bubble" if kind == "region" and pipeline else kind]
                label = e["name"] + (f" [{e['group']}]" if "group" in e else "") + \
                    (f" mb{e['microbatch']}" if e.get("microbatch") is not None else "")
                boxes.append(Box(LEFT + (e["t0"] - start) * scale, top + 2, max((e["t1"] - e["t0"]) * scale, 0.5),
                                 ROW - 4, colour, f"{label}: {(e['t1'] - e['t0']) * 1e3:.2f} ms"))
        top += ROW
    return top


def _waterfall(report: dict[str, Any], top: float, boxes: list[Box], texts: list[Text]) -> float:
    terms = report["terms"]
    planned_total = sum(v["planned_s"] or 0.0 for v in terms.values())
    span = max(sum(v["measured_s"] or 0.0 for v in terms.values()), planned_total, 1e-9)
    scale = (WIDTH - LEFT - 10) / span
    texts.append(Text(10, top + 14, f"waterfall: measured step {report['job']['step_s']:.3f} s, "
                                    f"planned {planned_total:.3f} s (thin bars)"))
    top += ROW
    at = 0.0
    for name, v in terms.items():
        measured = v["measured_s"] or 0.0  # None: not measured (pipeline_bubble under pp)
        if measured <= 0 and not v["planned_s"]:
            continue
        texts.append(Text(10, top + 14, name))
        boxes.append(Box(LEFT + at * scale, top + 2, max(measured * scale, 0.5), ROW - 8, _colour(name),
                         f"{name}: measured {measured:.4f} s"))
        if v["planned_s"] is not None:
            boxes.append(Box(LEFT + at * scale, top + ROW - 6, max(v["planned_s"] * scale, 0.5), 3,
                             COLOURS["planned"], f"{name}: planned {v['planned_s']:.4f} s"))
        top += ROW
        if name == "compute":
            top = _kinds(report.get("compute_by_kind", {}), LEFT + at * scale, scale, top, boxes, texts)
        at += measured
    return top


def _kinds(kinds: dict[str, Any], left: float, scale: float, top: float, boxes: list[Box], texts: list[Text]) -> float:
    """The compute bar split by kind, one row each, laid end to end under it (optimizer has its own term)."""
    at = 0.0
    for kind, v in kinds.items():
        if kind == "optimizer":
            continue
        measured = v["measured_s"] or 0.0
        texts.append(Text(22, top + 14, f"compute: {kind}"))
        boxes.append(Box(left + at * scale, top + 2, max(measured * scale, 0.5), ROW - 8,
                         KIND_COLOURS.get(kind, "#999999"), f"{kind}: measured {measured:.4f} s"))
        if v.get("planned_s") is not None:
            boxes.append(Box(left + at * scale, top + ROW - 6, max(v["planned_s"] * scale, 0.5), 3,
                             COLOURS["planned"], f"{kind}: planned {v['planned_s']:.4f} s"))
        at += measured
        top += ROW
    return top


def scene(report: dict[str, Any], profile: dict[int, dict[str, Any]]) -> Scene:
    """The picture of `report` (training.analyse) over `profile` (training.read_profile)."""
    boxes: list[Box] = []
    texts: list[Text] = []
    top = _timeline(profile, 5.0, boxes, texts)
    top = _waterfall(report, top + ROW / 2, boxes, texts)
    return Scene(WIDTH, int(top + 10), boxes, texts)
