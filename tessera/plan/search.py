"""Layout search: enumerate the valid layouts, drop those that do not fit, rank the rest by
estimated step time, and say why each of the best wins.

Valid means: tp divides the node and the heads, kv heads, vocabulary and FFN sizes; pp and pp x vpp
divide the layers; cp splits the sequence into 2 cp chunks; ep divides the experts and
dp_shard x cp; the global batch divides into micro-batches over the data-parallel ranks; and the
sizes multiply to the world. The micro-batch size stays the configured one. Left out as dominated
(never faster, never smaller): tp > 1 without sequence parallelism (the same traffic, more
activation memory), GPipe (1F1B's bubble with more memory in flight), and ZeRO stages other than 1
when nothing is sharded (dp_shard x cp = 1: the stages coincide). Recomputation: none, selective,
op (torchtitan's save list) and full, on every layer; intervals, other save lists, FP8 storage and
offload are planned when configured, not searched.

Bounded time: the candidates are the mesh shapes (tp, pp, cp, dp_replicate, dp_shard: at most
tens of thousands for any world up to 2^20 ranks, whose divisors come from the world's own) times,
for each, its schedules, expert-parallel sizes (divisors of the expert count), ZeRO stages and
recomputation policies. They are counted before any is planned; when there are more than
`max_layouts` (MAX_SEARCH_LAYOUTS by default, each plan taking milliseconds), a uniform sample of
that many, drawn with a fixed seed, is planned instead, and the result says so (`SearchResult.sampled`).
"""

from __future__ import annotations

import dataclasses
import random
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from tessera.config.model import ModelConfig
from tessera.plan.cluster import Cluster
from tessera.plan.estimate import Plan, make_plan
from tessera.plan.layout import Layout, Workload, layout_problems
from tessera.plan.profile import ModelProfile

GiB = 2**30


MAX_SEARCH_LAYOUTS = 20_000  # candidate layouts planned at most (a few ms each): a search stays within minutes
SEARCH_RECOMPUTE = ("none", "selective", "op", "full")
SAMPLE_SEED = 0


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending (trial division up to sqrt(n): a world of 10^8 ranks costs 10^4 steps)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _mesh_shapes(cfg: ModelConfig, work: Workload, world: int, gpus_per_node: int) -> Iterator[tuple[int, ...]]:
    """(tp, pp, cp, dp_replicate, dp_shard) whose product is the world, tp inside a node; each size
    is filtered before the next is enumerated, from the divisors of the world (any divisor of a
    divisor of the world is one of them)."""
    all_divisors = divisors(world)

    def dividing(n: int) -> list[int]:
        return [d for d in all_divisors if n % d == 0]

    for tp in (d for d in all_divisors if d <= gpus_per_node):
        for pp in (d for d in dividing(world // tp) if cfg.n_layers % d == 0):
            for cp in (d for d in dividing(world // (tp * pp)) if d == 1 or work.seq_len % d == 0):
                dp = world // (tp * pp * cp)
                for rep in dividing(dp):
                    yield tp, pp, cp, rep, dp // rep


@dataclass(frozen=True)
class _Choices:
    """One mesh shape and the options that multiply it: schedules x ep x ZeRO stages x recompute."""

    shape: tuple[int, ...]
    schedules: tuple[tuple[str, int], ...]
    eps: tuple[int, ...]
    zeros: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.schedules) * len(self.eps) * len(self.zeros) * len(SEARCH_RECOMPUTE)

    def layout(self, index: int) -> Layout:
        """Candidate `index` (0 <= index < count) of this shape: ep slowest, then ZeRO stage,
        recompute, schedule."""
        index, sc = divmod(index, len(self.schedules))
        index, r = divmod(index, len(SEARCH_RECOMPUTE))
        e, z = divmod(index, len(self.zeros))
        tp, pp, cp, rep, shard = self.shape
        schedule, v = self.schedules[sc]
        return Layout(tp=tp, sp=tp > 1, pp=pp, vpp=v, pp_schedule=schedule, dp_replicate=rep, dp_shard=shard,
                      cp=cp, ep=self.eps[e], zero_stage=self.zeros[z], recompute=SEARCH_RECOMPUTE[r])


def _choices(cfg: ModelConfig, work: Workload, world: int, gpus_per_node: int) -> list[_Choices]:
    expert_sizes = [1] if cfg.moe is None else divisors(cfg.moe.num_experts)
    out = []
    for tp, pp, cp, rep, shard in _mesh_shapes(cfg, work, world, gpus_per_node):
        schedules = [("1f1b", 1)]
        if pp > 1:
            schedules += [("zero_bubble", 1)] + [("interleaved_1f1b", v) for v in (2, 4)
                                                  if cfg.n_layers % (pp * v) == 0]
        eps = tuple(e for e in expert_sizes if (shard * cp) % e == 0)
        zeros = (1, 2, 3) if shard * cp > 1 else (1,)
        out.append(_Choices((tp, pp, cp, rep, shard), tuple(schedules), eps, zeros))
    return out


@dataclass(frozen=True)
class Candidates:
    """The layouts a search plans: all of them, or a uniform sample (`sampled`) of `total`."""

    layouts: Iterator[Layout]
    total: int  # candidates before validity
    sampled: bool
    planned_at_most: int


def candidate_layouts(cfg: ModelConfig, work: Workload, world: int, gpus_per_node: int,
                      max_layouts: int = MAX_SEARCH_LAYOUTS) -> Candidates:
    """The valid layouts to plan: every candidate when there are at most `max_layouts`, else a
    uniform sample of `max_layouts` of them (seed SAMPLE_SEED), the invalid ones dropped."""
    choices = _choices(cfg, work, world, gpus_per_node)
    counts = list(accumulate(c.count for c in choices))
    total = counts[-1] if counts else 0
    sampled = total > max_layouts
    picks = sorted(random.Random(SAMPLE_SEED).sample(range(total), max_layouts)) if sampled else range(total)

    def layouts() -> Iterator[Layout]:
        for i in picks:
            at = bisect_right(counts, i)
            lay = choices[at].layout(i - (counts[at - 1] if at else 0))
            if not layout_problems(cfg, lay, work, even_layers=True):
                yield lay

    return Candidates(layouts(), total, sampled, min(total, max_layouts))


def enumerate_layouts(cfg: ModelConfig, work: Workload, world: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every layout of `world` ranks this model and workload can run (tp within a node), unbounded:
    `candidate_layouts` is the bounded form the search uses."""
    return candidate_layouts(cfg, work, world, gpus_per_node, max_layouts=2**62).layouts


def time_components(plan: Plan) -> dict[str, float]:
    """Seconds of a step by cause: compute (with recomputation), bubble, exposed communication per
    group, optimizer. They add up to the step time."""
    t = plan.time
    slow = max(t.stages, key=lambda s: s.per_microbatch)
    out = {"compute": t.microbatches * slow.compute, "bubble": t.microbatches * slow.per_microbatch * t.bubble}
    for group, sec in slow.exposed.items():
        out[f"{group} comm"] = out.get(f"{group} comm", 0.0) + t.microbatches * sec
    for group, sec in t.step_exposed.items():
        out[f"{group} comm"] = out.get(f"{group} comm", 0.0) + sec
    out["optimizer"] = t.optimizer
    return {k: v for k, v in out.items() if v > 0}


def _differences(a: Plan, b: Plan) -> str:
    """What makes `a` faster than `b`: the components where it saves the most time."""
    ca, cb = time_components(a), time_components(b)
    deltas = sorted(((cb.get(k, 0.0) - ca.get(k, 0.0), k) for k in set(ca) | set(cb)), reverse=True)
    parts = [f"{d:.2f} s less {k}" for d, k in deltas if d > 0.005][:2]
    worse = [f"{-d:.2f} s more {k}" for d, k in deltas if d < -0.005][-1:]
    return ", ".join(parts + worse) or "equal time, less memory"


@dataclass
class SearchResult:
    ranked: list[Plan]  # fitting layouts, fastest first
    valid: int  # layouts planned (all valid)
    too_big: list[Plan] = field(default_factory=list)  # valid but over the memory, smallest first
    candidates: int = 0  # candidate layouts of the whole space (valid or not)
    sampled: bool = False  # True: only a uniform sample of `sample_size` candidates was planned
    sample_size: int = 0

    def coverage(self) -> str:
        """One line saying whether the whole space was searched."""
        if not self.sampled:
            return f"all {self.candidates:,} candidate layouts examined"
        return (f"a uniform sample of {self.sample_size:,} of {self.candidates:,} candidate layouts examined "
                f"(more than the bound of {self.sample_size:,}; seed {SAMPLE_SEED}): the best layout of the whole "
                "space may be missing; fix some parallel.* sizes with --set to search the rest exhaustively")

    def reasons(self, top: int) -> list[str]:
        """Why each of the first `top` layouts wins: its time split and its edge over the next one."""
        out = []
        for i, p in enumerate(self.ranked[:top]):
            comp = time_components(p)
            main = max(comp, key=comp.get)
            line = (f"{p.time.total:.2f} s/step, MFU {100 * p.mfu:.1f}%, peak {p.peak.total / GiB:.1f} GiB; "
                    f"{main} is {100 * comp[main] / p.time.total:.0f}% of the step")
            if i + 1 < len(self.ranked):
                nxt = self.ranked[i + 1]
                line += f"; beats the next ({nxt.layout.describe()}): {_differences(p, nxt)}"
            out.append(line)
        return out

    def alternatives(self, count: int = 3) -> list[str]:
        """Why the winner beats other mesh shapes: the fastest fitting layout of the next `count`
        other (tp, pp, cp, ep) shapes and of pure data parallelism, with the time it loses and where."""
        if not self.ranked:
            return []
        best = self.ranked[0]
        shape = (best.layout.tp, best.layout.pp, best.layout.cp, best.layout.ep)
        seen, out = {shape}, []
        for p in self.ranked[1:]:
            key = (p.layout.tp, p.layout.pp, p.layout.cp, p.layout.ep)
            if key in seen:
                continue
            seen.add(key)
            if len(out) >= count and key != (1, 1, 1, 1):
                continue
            out.append(f"{p.layout.describe()}: {p.time.total - best.time.total:.2f} s/step slower "
                       f"({_differences(best, p)} for the winner)")
            if len(out) > count or (len(out) == count and (1, 1, 1, 1) in seen):
                break
        return out


def search(cfg: ModelConfig, work: Workload, cluster: Cluster, *, precision: str = "bf16",
           activation_dtype: str = "autocast-bf16", overlaps: dict[str, bool] | None = None,
           max_layouts: int = MAX_SEARCH_LAYOUTS, teacher: ModelConfig | None = None) -> SearchResult:
    """Plan every valid layout of the cluster (or a uniform sample when the space holds more than
    `max_layouts` candidates); rank those that fit by predicted throughput (the same tokens per
    step: by step time), ties by peak memory. `overlaps` (tp_overlap, ep_overlap) apply to every
    layout. With `teacher` (train.distill.teacher's model) every plan holds its weights (cut by the
    layout, pipeline stages included), and layouts with more stages than the teacher has layers are skipped."""
    fitting: list[Plan] = []
    too_big: list[Plan] = []
    count = 0
    profile = ModelProfile.of(cfg, work.seq_len)
    candidates = candidate_layouts(cfg, work, cluster.gpus, cluster.gpus_per_node, max_layouts)
    for lay in candidates.layouts:
        if teacher is not None and teacher.n_layers < lay.pp * lay.vpp:
            continue  # the teacher is cut into the student's stages: at least one layer each
        count += 1
        if overlaps:
            lay = dataclasses.replace(lay, **overlaps)
        plan = make_plan(cfg, lay, work, cluster, precision=precision, activation_dtype=activation_dtype,
                         even_layers=True, profile=profile, teacher=teacher)
        (fitting if plan.fits else too_big).append(plan)
    fitting.sort(key=lambda p: (round(p.time.total, 6), p.peak.total))
    too_big.sort(key=lambda p: p.peak.total)
    return SearchResult(ranked=fitting, valid=count, too_big=too_big[:3], candidates=candidates.total,
                        sampled=candidates.sampled, sample_size=candidates.planned_at_most)
