"""`tessera profile DIR` on a serving profile (`tessera serve --profile-dir DIR`, POST /profile/start
and /profile/stop: DIR/engine.jsonl, tessera/infer/engine/step_profile.py): each step's composition
and each request's life.

    {"kind": "serving", "steps": [{"step", "session", "t0", "t1", "schedule_s", "forward_s", "update_s",
     "prefill_tokens", "decode_tokens"}, ...],
     "terms": {"schedule"|"forward"|"update"|"idle": {"measured_s", "planned_s": None}} (per step),
     and the forward's parts, "forward/attention", "forward/mlp", "forward/norm", "forward/lm_head",
     "forward/model_other", "forward/sampling", "forward/kv_copies" (forward_parts.py; they add up to
     "forward"; absent from a profile recorded before the split),
     "tokens": {"prefill", "decode"},
     "requests": {id: {"queued_s", "prefill_chunks", "prefill_tokens", "decode_steps", "preemptions",
                       "finish_reason", "life": [[phase, t0, t1], ...]}},
     "http": {"requests": N, "per_request": {"read_s", "parse_s", "engine_s", "write_s", "send_s"},
              "by_request": [{"path", "status", "t0", "t1", the parts, "ids"}, ...]}}

`idle` is the time between the recorded steps (the engine waiting for work, or between sessions).
`http` holds the HTTP requests the server answered while recording (tessera/infer/api/http_profile.py:
reading the body, parsing up to the engine, the engine, writing the answer; `per_request` their
means), absent from a profile recorded without them; an engine request an HTTP request made holds
that request's `"http": [[part, t0, t1], ...]` (its `http parse` and `http write`), drawn on its row
before and after its life.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera.config.errors import ConfigError
from tessera.profiling.picture import COLOURS, KIND_COLOURS, LEFT, ROW, WIDTH, Box, Scene, Text

ENGINE_FILE = "engine.jsonl"
_PARTS = ("schedule", "forward", "update")
FORWARD_PARTS = ("attention", "mlp", "norm", "lm_head", "model_other", "sampling", "kv_copies")
_FORWARD_COLOURS = {"attention": KIND_COLOURS["attention"], "mlp": KIND_COLOURS["mlp"], "norm": KIND_COLOURS["norm"],
                    "lm_head": KIND_COLOURS["loss"], "model_other": KIND_COLOURS["other"],
                    "sampling": COLOURS["optimizer"], "kv_copies": COLOURS["comm"]}
_PHASE_COLOURS = {"prefill": COLOURS["compute"], "decode": COLOURS["optimizer"], "preempted": COLOURS["comm"],
                  "finished": "#333333"}
MAX_REQUEST_ROWS = 40
HTTP_PARTS = ("read", "parse", "engine", "write", "send")
_PHASE_COLOURS.update({"http parse": KIND_COLOURS["attention"], "http write": KIND_COLOURS["mlp"]})


def is_serving_profile(directory: Path) -> bool:
    return (Path(directory) / ENGINE_FILE).is_file()


def read_steps(directory: Path) -> list[dict[str, Any]]:
    steps, session = [], 0
    for line in (Path(directory) / ENGINE_FILE).read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        if "http" in item:
            continue  # an HTTP request's line (read_http)
        if "session" in item:
            session = item["session"]
        else:
            steps.append({**item, "session": session})
    if not steps:
        raise ConfigError(f"{ENGINE_FILE} in {Path(directory).name!r} is invalid: it holds no engine step; "
                          "POST /profile/start, send requests, then POST /profile/stop")
    return steps


def read_http(directory: Path) -> list[dict[str, Any]]:
    """The HTTP requests' lines of engine.jsonl (none in a profile recorded without them)."""
    lines = (Path(directory) / ENGINE_FILE).read_text().splitlines()
    return [item["http"] for item in map(json.loads, filter(str.strip, lines)) if "http" in item]


def _http_section(http: list[dict[str, Any]], lives: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The HTTP requests' parts, their means, and their parse and write in their engine requests' lives."""
    for h in http:
        parsed_at = h["t0"] + h["read_s"]
        for rid in h["ids"]:
            if rid in lives:
                lives[rid]["http"] = [["http parse", parsed_at, parsed_at + h["parse_s"]],
                                      ["http write", h["t1"] - h["write_s"], h["t1"]]]
    mean = {f"{p}_s": sum(h[f"{p}_s"] for h in http) / len(http) for p in HTTP_PARTS}
    return {"requests": len(http), "per_request": mean, "by_request": http}


def _request_lives(steps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    lives: dict[str, dict[str, Any]] = {}
    for s in steps:
        for r in s["requests"]:
            life = lives.setdefault(r["id"], {"queued_s": None, "prefill_chunks": 0, "prefill_tokens": 0,
                                              "decode_steps": 0, "preemptions": 0, "finish_reason": None, "life": []})
            if "queued_s" in r and life["queued_s"] is None:
                life["queued_s"] = r["queued_s"]
                life["life"].append(["queued", s["t0"] - r["queued_s"], s["t0"]])
            phase = r["phase"]
            if phase == "prefill":
                life["prefill_chunks"] += 1
                life["prefill_tokens"] += r["tokens"]
            elif phase == "decode":
                life["decode_steps"] += 1
            elif phase == "preempted":
                life["preemptions"] += 1
            else:
                life["finish_reason"] = r.get("reason")
            life["life"].append([phase, s["t0"], s["t1"]])
    return lives


def analyse_serving(directory: Path | str) -> dict[str, Any]:
    steps = read_steps(Path(directory))
    n = len(steps)
    gaps = sum(max(b["t0"] - a["t1"], 0.0) for a, b in zip(steps, steps[1:], strict=False))
    split = all("attention_s" in s for s in steps)
    names = ["schedule", "forward", *(f"forward/{part}" for part in FORWARD_PARTS if split), "update"]
    terms = {name: {"measured_s": sum(s[f"{name.split('/')[-1]}_s"] for s in steps) / n, "planned_s": None}
             for name in names}
    terms["idle"] = {"measured_s": gaps / n, "planned_s": None}
    lives = _request_lives(steps)
    http = read_http(Path(directory))
    keep = ("step", "session", "t0", "t1", "schedule_s", "forward_s", "update_s", "prefill_tokens", "decode_tokens",
            *(f"{part}_s" for part in FORWARD_PARTS if split))
    return {"kind": "serving", "steps": [{k: s[k] for k in keep} for s in steps], "terms": terms,
            "tokens": {"prefill": sum(s["prefill_tokens"] for s in steps),
                       "decode": sum(s["decode_tokens"] for s in steps)},
            "requests": lives, **({"http": _http_section(http, lives)} if http else {})}


def serving_summary(report: dict[str, Any]) -> str:
    steps, requests = report["steps"], report["requests"]
    lines = [f"{len(steps)} engine steps, {report['tokens']['prefill']} prefill and {report['tokens']['decode']} "
             f"decode tokens, {len(requests)} requests"]
    lines += [f"  {name:10s} {v['measured_s'] * 1e3:9.3f} ms per step" if "/" not in name else
              f"    {name.split('/')[1]:12s} {v['measured_s'] * 1e3:9.3f} ms" for name, v in report["terms"].items()]
    if "http" in report:
        http = report["http"]
        lines.append(f"  HTTP, {http['requests']} requests, per request:")
        lines += [f"    {part:12s} {http['per_request'][f'{part}_s'] * 1e3:9.3f} ms" + (
            " (of the above, in the server's send)" if part == "send" else "") for part in HTTP_PARTS]
    preempted = {k: v["preemptions"] for k, v in requests.items() if v["preemptions"]}
    if preempted:
        lines.append("preempted: " + ", ".join(f"{k} ({n}x)" for k, n in preempted.items()))
    return "\n".join(lines)


def serving_scene(report: dict[str, Any]) -> Scene:
    """The engine's steps split into their parts on one row, then each request's life on its own."""
    steps = report["steps"]
    lives = list(report["requests"].items())[:MAX_REQUEST_ROWS]
    start = min([steps[0]["t0"], *(seg[1] for _, v in lives for seg in v["life"] + v.get("http", []))])
    scale = (WIDTH - LEFT - 10) / max(steps[-1]["t1"] - start, 1e-9)
    boxes, texts = [], [Text(10, 19, "engine steps")]
    for s in steps:
        at = s["t0"]
        for part, colour in zip(_PARTS, (COLOURS["data"], COLOURS["compute"], COLOURS["checkpoint"]), strict=True):
            inner = [p for p in FORWARD_PARTS if f"{p}_s" in s] if part == "forward" else []
            for name in inner or [part]:  # the forward drawn as its parts when it was split
                seconds = s[f"{name}_s"]
                title = f"step {s['step']} {name}: {seconds * 1e3:.2f} ms"
                boxes.append(Box(LEFT + (at - start) * scale, 7, max(seconds * scale, 0.5), ROW - 4,
                                 _FORWARD_COLOURS.get(name, colour), title))
                at += seconds
    top = 5 + ROW * 1.5
    for rid, life in lives:
        texts.append(Text(10, top + 15, rid[:22]))
        for phase, t0, t1 in life.get("http", []) + life["life"]:
            boxes.append(Box(LEFT + (t0 - start) * scale, top + 2, max((t1 - t0) * scale, 1.0), ROW - 4,
                             _PHASE_COLOURS.get(phase, COLOURS["idle"]), f"{rid} {phase}"))
        top += ROW
    return Scene(WIDTH, int(top + 10), boxes, texts)
