"""Layout search: enumerate every valid layout, drop those that do not fit, rank the rest by
estimated step time, and say why each of the best wins.

Valid means: tp divides the node and the heads, kv heads, vocabulary and FFN sizes; pp and pp x vpp
divide the layers; cp splits the sequence into 2 cp chunks; ep divides the experts and
dp_shard x cp; the global batch divides into micro-batches over the data-parallel ranks; and the
sizes multiply to the world. The micro-batch size stays the configured one. Left out as dominated
(never faster, never smaller): tp > 1 without sequence parallelism (the same traffic, more
activation memory), GPipe (1F1B's bubble with more memory in flight), and ZeRO stages other than 1
when nothing is sharded (dp_shard x cp = 1: the stages coincide).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product

from tessera.config.model import ModelConfig
from tessera.config.parallel import RECOMPUTE_CHOICES
from tessera.plan.cluster import Cluster
from tessera.plan.estimate import Plan, make_plan
from tessera.plan.layout import Layout, Workload, layout_problems
from tessera.plan.profile import ModelProfile

GiB = 2**30


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending (trial division up to sqrt(n): a world of 10^8 ranks costs 10^4 steps)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _mesh_shapes(cfg: ModelConfig, work: Workload, world: int, gpus_per_node: int) -> Iterator[tuple[int, ...]]:
    """(tp, pp, cp, dp_replicate, dp_shard) whose product is the world, tp inside a node; each size
    is filtered before the next is enumerated."""
    for tp in (d for d in divisors(world) if d <= gpus_per_node):
        for pp in (d for d in divisors(world // tp) if cfg.n_layers % d == 0):
            for cp in (d for d in divisors(world // (tp * pp)) if d == 1 or work.seq_len % d == 0):
                dp = world // (tp * pp * cp)
                for rep in divisors(dp):
                    yield tp, pp, cp, rep, dp // rep


def enumerate_layouts(cfg: ModelConfig, work: Workload, world: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every layout of `world` ranks this model and workload can run (tp within a node)."""
    for tp, pp, cp, rep, shard in _mesh_shapes(cfg, work, world, gpus_per_node):
        schedules = [("1f1b", 1)]
        if pp > 1:
            schedules += [("zero_bubble", 1)] + [("interleaved_1f1b", v) for v in (2, 4)
                                                  if cfg.n_layers % (pp * v) == 0]
        eps = [1] if cfg.moe is None else [e for e in divisors(cfg.moe.num_experts) if (shard * cp) % e == 0]
        zeros = (1, 2, 3) if shard * cp > 1 else (1,)
        for ep, zero, recompute, (schedule, v) in product(eps, zeros, RECOMPUTE_CHOICES, schedules):
            lay = Layout(tp=tp, sp=tp > 1, pp=pp, vpp=v, pp_schedule=schedule, dp_replicate=rep, dp_shard=shard,
                         cp=cp, ep=ep, zero_stage=zero, recompute=recompute)
            if not layout_problems(cfg, lay, work, even_layers=True):
                yield lay


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
    valid: int  # layouts enumerated (all valid)
    too_big: list[Plan] = field(default_factory=list)  # valid but over the memory, smallest first

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
           activation_dtype: str = "autocast-bf16", overlaps: dict[str, bool] | None = None) -> SearchResult:
    """Plan every valid layout of the cluster; rank those that fit by predicted throughput (the
    same tokens per step: by step time), ties by peak memory. `overlaps` (tp_overlap, ep_overlap)
    apply to every layout."""
    fitting: list[Plan] = []
    too_big: list[Plan] = []
    count = 0
    profile = ModelProfile.of(cfg, work.seq_len)
    for lay in enumerate_layouts(cfg, work, cluster.gpus, cluster.gpus_per_node):
        count += 1
        if overlaps:
            lay = dataclasses.replace(lay, **overlaps)
        plan = make_plan(cfg, lay, work, cluster, precision=precision, activation_dtype=activation_dtype,
                         even_layers=True, profile=profile)
        (fitting if plan.fits else too_big).append(plan)
    fitting.sort(key=lambda p: (round(p.time.total, 6), p.peak.total))
    too_big.sort(key=lambda p: p.peak.total)
    return SearchResult(ranked=fitting, valid=count, too_big=too_big[:3])
