"""Recording the serving engine's steps between `POST /profile/start` and `POST /profile/stop`
(`tessera serve --profile-dir DIR`), for `tessera profile DIR` (tessera/profiling/serving.py).

While recording, each step is timed in its parts, on the engine thread:

    schedule_s   the scheduler's plan (admission, chunking, preemption, KV tier planning)
    forward_s    the executor: the model's forward over the plan's tokens and the sampling
    update_s     applying the results (detokenizing, stops, finishing requests)

and forward_s split into attention_s, mlp_s, norm_s, lm_head_s, model_other_s, sampling_s and
kv_copies_s (forward_parts.py), which add up to it;

with the plan's prefill and decode tokens, and for each request what happened to it in the step: a
prefill chunk (its tokens), a decode, a preemption, its end (with the reason). A request's first
line also says how long it queued (from its arrival to the step that first scheduled it).

Each recording session is appended to DIR/engine.jsonl on stop: a `{"session": N, "start": t}` line,
then one line per step `{"step", "t0", "t1", "schedule_s", "forward_s", "update_s", the forward's
parts, "prefill_tokens", "decode_tokens", "requests": [{"id", "phase", "tokens"[, "queued_s"|"reason"]}]}`,
then one line per HTTP request the server answered during the session (tessera/infer/api/http_profile.py)
`{"http": {"path", "status", "t0", "t1", "read_s", "parse_s", "engine_s", "write_s", "send_s", "ids"}}`,
times in seconds (monotonic clock). Outside a session the engine's step is untouched.

The HTTP side meets the engine here: while a request is recorded its handler's context holds an
`HttpRecord` (`HTTP_REQUEST`), and `EngineLoop.submit` notes in it when the request reached the
engine and when the engine's final output for it came back (`note_submission`).
"""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.infer.engine.forward_parts import ForwardParts

ENGINE_FILE = "engine.jsonl"


@dataclass
class HttpRecord:
    """What the server knows of one HTTP request being recorded (monotonic seconds; None: not yet)."""

    t0: float
    submitted: float | None = None  # the first engine request queued
    answered: float | None = None  # the last engine request's final output delivered
    ids: list[str] = field(default_factory=list)  # its engine requests
    pending: int = 0  # of them, not finished yet


HTTP_REQUEST: ContextVar[HttpRecord | None] = ContextVar("tessera_http_request", default=None)


def note_submission(request_id: str, callback):
    """`callback` as it is, or, when the calling context serves a recorded HTTP request, noting in its
    record the engine request and the time of its final output (called in the engine thread)."""
    record = HTTP_REQUEST.get()
    if record is None:
        return callback
    if record.submitted is None:
        record.submitted = time.monotonic()
    record.ids.append(request_id)
    record.pending += 1

    def noted(out):
        if out.finished:
            record.pending -= 1
            if record.pending == 0:
                record.answered = time.monotonic()
        return callback(out)

    return noted


class EngineProfile:
    """The recorder one engine holds (`LLMEngine.profile`); `start`/`stop` run on the engine thread."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.recording = False
        self.lines: list[dict[str, Any]] = []
        self.http: list[dict[str, Any]] = []  # the session's HTTP requests (appended on the server's thread)
        self.sessions = 0
        self._seen: set[str] = set()  # requests whose queueing was recorded

    def start(self) -> dict[str, Any]:
        if not self.recording:
            self.recording, self.sessions = True, self.sessions + 1
            self.lines, self.http = [{"session": self.sessions, "start": time.monotonic()}], []
        return {"recording": True, "session": self.sessions}

    def stop(self) -> dict[str, Any]:
        """Append the session to DIR/engine.jsonl; the steps it held."""
        if not self.recording:
            return {"recording": False, "steps": 0}
        self.recording = False
        http, self.http = self.http, []
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ENGINE_FILE, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in self.lines)
            f.writelines(json.dumps({"http": line}) + "\n" for line in http)
        steps, self.lines = len(self.lines) - 1, []
        return {"recording": False, "session": self.sessions, "steps": steps, "http_requests": len(http),
                "file": ENGINE_FILE}

    def timed_step(self, engine) -> list:
        """`engine.step()` with its parts timed and its plan described (the module docstring)."""
        t0 = time.monotonic()
        plan = engine.scheduler.schedule()
        t1 = time.monotonic()
        requests = [self._scheduled(s, t0) for s in plan.scheduled]  # before the step moves the sequences on
        with ForwardParts(engine.executor) as parts:
            result = engine.executor.execute_model(plan)
        t2 = time.monotonic()
        try:
            outputs = engine.scheduler.update_from_output(plan, result).outputs
        finally:
            engine.executor.clear_blocks(engine.scheduler.take_dirty_blocks())
        t3 = time.monotonic()
        requests += [{"id": seq.request_id, "phase": "preempted", "tokens": 0} for seq in plan.preempted]
        requests += [{"id": o.request_id, "phase": "finished", "tokens": 0, "reason": o.finish_reason}
                     for o in outputs if o.finished]
        prefill = sum(r["tokens"] for r in requests if r["phase"] == "prefill")
        decode = sum(r["tokens"] for r in requests if r["phase"] == "decode")
        self.lines.append({"step": len(self.lines), "t0": t0, "t1": t3, "schedule_s": t1 - t0, "forward_s": t2 - t1,
                           "update_s": t3 - t2, **parts.split(t2 - t1), "prefill_tokens": prefill,
                           "decode_tokens": decode, "requests": requests})
        return outputs

    def _scheduled(self, s, t0: float) -> dict[str, Any]:
        seq = s.seq
        phase = "decode" if seq.is_decoding else "prefill"  # a recomputation after a preemption is a prefill
        line: dict[str, Any] = {"id": seq.request_id, "phase": phase, "tokens": s.num_tokens}
        if seq.request_id not in self._seen:
            self._seen.add(seq.request_id)
            line["queued_s"] = max(t0 - seq.arrival, 0.0)
        return line
