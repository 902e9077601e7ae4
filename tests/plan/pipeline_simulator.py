"""A small discrete-event simulation of pipeline schedules, to check the bubble and in-flight
formulas by running the schedules rather than by restating them.

Each rank executes its own ordered list of forward (F) and backward (B) passes of (micro-batch,
model chunk); a pass starts when the rank is free and its dependency is done: F of virtual stage
j after F of stage j - 1, B of stage j after B of stage j + 1 (and after its own F). A rank of an
interleaved schedule holds chunks r, r + p, ... (virtual stages). Orders follow Megatron-LM:
GPipe (all F, then all B), 1F1B (p - r - 1 warm-up forwards), interleaved 1F1B
((p - r - 1) * 2 + (v - 1) * p warm-up forwards, micro-batches taken p at a time per chunk).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Simulation:
    makespan: float
    busy: float  # per rank (all ranks carry the same work)
    peak_in_flight: list[float]  # per rank, in micro-batches' worth of a whole stage (chunks / v)

    @property
    def bubble_fraction(self) -> float:
        return (self.makespan - self.busy) / self.busy


def _interleaved_ids(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's k-th forward or backward pass (Megatron's ordering)."""
    group, within = divmod(k, p * v)
    chunk = within // p
    if not forward:
        chunk = v - 1 - chunk
    return group * p + within % p, chunk


def rank_order(schedule: str, p: int, m: int, v: int, r: int) -> list[tuple[str, int, int]]:
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - r - 1, m)
        order = [("F", i, 0) for i in range(warm)]
        f = b = 0
        for f in range(warm, m):
            order += [("F", f, 0), ("B", b, 0)]
            b += 1
        return order + [("B", i, 0) for i in range(b, m)]
    if schedule == "interleaved_1f1b":
        total = m * v
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [("F", *_interleaved_ids(k, p, v, True)) for k in range(warm)]
        b = 0
        for f in range(warm, total):
            order += [("F", *_interleaved_ids(f, p, v, True)), ("B", *_interleaved_ids(b, p, v, False))]
            b += 1
        return order + [("B", *_interleaved_ids(k, p, v, False)) for k in range(b, total)]
    raise ValueError(schedule)


def simulate(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0) -> Simulation:
    """Run the schedule; `t_f`, `t_b` are one whole stage's forward and backward time per micro-batch."""
    orders = [rank_order(schedule, p, m, v, r) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> finish time
    free = [0.0] * p
    pos = [0] * p
    last = p * v - 1
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, mb, chunk = orders[r][pos[r]]
                stage = chunk * p + r
                if kind == "F":
                    deps = [("F", mb, stage - 1)] if stage > 0 else []
                else:
                    deps = [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < last else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = start + (t_f if kind == "F" else t_b) / v
                done[(kind, mb, stage)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} deadlocks with p={p}, m={m}, v={v}")
    peaks = []
    for order in orders:
        held = peak = 0
        for kind, _, _ in order:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak / v)
    return Simulation(makespan=max(free), busy=m * (t_f + t_b), peak_in_flight=peaks)
