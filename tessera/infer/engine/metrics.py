"""Serving metrics, exposed in the Prometheus text format (version 0.0.4).

Counters are updated by the engine thread only and read by the server: plain Python numbers,
whose reads are atomic under the GIL. TTFT is the time from arrival to the first token; TPOT the
mean time between the following tokens of a request.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = TIME_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(TIME_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, c in zip(self.buckets, self.counts):
            running += c
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return out


@dataclass
class EngineMetrics:
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    preemptions: int = 0
    steps: int = 0
    spec_steps: int = 0  # (sequence, step) pairs that verified proposals
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_emitted: int = 0  # tokens those verifications produced (accepted + 1 each, before stops)

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.spec_emitted / self.spec_steps if self.spec_steps else 0.0

    def speculation(self, proposed: int, emitted: int) -> None:
        """One verification of `proposed` speculative tokens that emitted `emitted` tokens (the
        accepted ones and the target's own after them)."""
        self.spec_steps += 1
        self.spec_proposed += proposed
        self.spec_accepted += emitted - 1
        self.spec_emitted += emitted

    def finish(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def prometheus(self, gauges: dict[str, float], cache_queried: int, cache_hits: int) -> str:
        """The metrics page; `gauges` are point-in-time values (running, waiting, free blocks, ...)."""
        p = "tessera"
        lines = [f"# HELP {p}_requests_total Finished requests by finish reason.", f"# TYPE {p}_requests_total counter"]
        finished = self.requests_finished.copy()  # the engine thread may add a reason meanwhile
        for reason in sorted(set(finished) | {"stop", "length"}):
            lines.append(f'{p}_requests_total{{finish_reason="{reason}"}} {finished.get(reason, 0)}')
        counters = {
            "prompt_tokens_total": (self.prompt_tokens, "Prompt tokens of admitted requests."),
            "generation_tokens_total": (self.generation_tokens, "Generated tokens."),
            "preemptions_total": (self.preemptions, "Sequences preempted for lack of KV blocks."),
            "engine_steps_total": (self.steps, "Engine steps run."),
            "prefix_cache_queried_tokens_total": (cache_queried, "Prompt tokens looked up in the prefix cache."),
            "prefix_cache_hit_tokens_total": (cache_hits, "Prompt tokens found in the prefix cache."),
            "spec_proposed_tokens_total": (self.spec_proposed, "Speculative tokens proposed."),
            "spec_accepted_tokens_total": (self.spec_accepted, "Speculative tokens accepted."),
        }
        for name, (value, doc) in counters.items():
            lines += [f"# HELP {p}_{name} {doc}", f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
        derived = {
            "prefix_cache_hit_rate": (cache_hits / cache_queried if cache_queried else 0.0,
                                      "Share of looked-up prompt tokens served from the prefix cache."),
            "spec_acceptance_rate": (self.acceptance_rate, "Accepted / proposed speculative tokens."),
            "spec_tokens_per_step": (self.tokens_per_step, "Tokens emitted per speculative verification."),
        }
        for name, (value, doc) in {**derived, **{k: (v, k.replace("_", " ")) for k, v in gauges.items()}}.items():
            lines += [f"# HELP {p}_{name} {doc}", f"# TYPE {p}_{name} gauge", f"{p}_{name} {value}"]
        for name, hist, doc in (("time_to_first_token_seconds", self.ttft, "Arrival to first token."),
                                ("time_per_output_token_seconds", self.tpot, "Mean time between later tokens.")):
            lines += [f"# HELP {p}_{name} {doc}", f"# TYPE {p}_{name} histogram", *hist.lines(f"{p}_{name}")]
        return "\n".join(lines) + "\n"
