"""Step time: each operator at the rate its shapes allow, each collective at its link's latency
and bandwidth, and only the overlap each part of the schedule allows.

For one rank of each pipeline stage and one micro-batch (every term is printed by `tessera plan`):
  compute   = forward x 3 (+ recomputed forward) of its layers and head, operator by operator
              (tessera/plan/op_time.py: GEMMs from their m, n, k; attention from the sequence
              length; grouped expert GEMMs from rows per expert; elementwise work from its bytes)
  exposed   = per collective (tessera/plan/comm.py), log2(n) x link latency + bytes / bus bandwidth,
              less what its overlap window hides:
              TP/SP        on the critical path (`tp_overlap`: hidden behind the layer's GEMMs)
              EP all-to-all on the critical path (`ep_overlap`, a DualPipe-style or 1F1B
                           A2A-overlap schedule: hidden behind another micro-batch's compute)
              PP send/recv on the critical path (interleaved 1F1B, DualPipe: hidden behind
                           another micro-batch)
              CP           hidden behind the attention core (ring / all-gather overlap)
              ZeRO-2/3     hidden behind the micro-batch's compute (FSDP prefetch, bucketed
                           reduce-scatter)
The slowest stage sets the pace: pipeline time = m x max_stage(compute + exposed) x (1 + bubble).
Then once per step: gradient collectives that only the last micro-batch's backward can hide
(distributed-optimizer buckets), weight all-gathers that only the first forward can hide, and
the optimizer's pass over its shard of the model states, bound by memory bandwidth (AdamW reads
and writes about 30 bytes per parameter of fp32 state). Tokens/s and MFU follow from the step
time; MFU counts model FLOPs (`tessera.models.flops.flops_per_token`), so recomputation lowers it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.config.model import ModelConfig
from tessera.plan.bubble import bubble_fraction
from tessera.plan.cluster import Cluster
from tessera.plan.comm import Collective
from tessera.plan.layout import Layout, Workload
from tessera.plan.op_time import stage_compute_time
from tessera.plan.profile import ModelProfile

# Schedules whose sends and receives run under another micro-batch's compute: interleaved 1F1B
# (Megatron-LM's overlapped P2P) and DualPipe (DeepSeek-V3 hides PP traffic with its all-to-all).
P2P_OVERLAP_SCHEDULES = ("interleaved_1f1b", "dualpipe")
OPTIMIZER_BYTES_PER_PARAM = 30.0  # AdamW on fp32 state: read p, g, m, v; write p, m, v; a 16-bit copy


@dataclass
class StageTime:
    stage: int
    compute: float  # seconds per micro-batch
    attention: float  # of which the attention core
    exposed: dict[str, float] = field(default_factory=dict)  # exposed seconds per micro-batch, by group
    matmul: float = 0.0  # of which matrix products
    memory: float = 0.0  # of which elementwise work bound by HBM bandwidth
    transfer: float = 0.0  # of which activation offload copies to host memory and back

    @property
    def per_microbatch(self) -> float:
        return self.compute + sum(self.exposed.values())


@dataclass
class StepTime:
    stages: list[StageTime]
    microbatches: int
    bubble: float
    pipeline: float  # seconds: m x slowest stage x (1 + bubble)
    step_exposed: dict[str, float]  # once-per-step exposed communication, by group
    optimizer: float
    comm_seconds: dict[str, float]  # total link time per group per step (hidden or not)

    @property
    def total(self) -> float:
        return self.pipeline + sum(self.step_exposed.values()) + self.optimizer

    @property
    def compute(self) -> float:
        return self.microbatches * max(s.compute for s in self.stages)

    def as_dict(self) -> dict:
        slow = max(self.stages, key=lambda s: s.per_microbatch)
        return {"total": self.total, "compute": self.compute, "bubble_fraction": self.bubble,
                "bubble": self.microbatches * slow.per_microbatch * self.bubble,
                "exposed_per_step": {g: self.microbatches * t for g, t in slow.exposed.items()}
                | {f"{g} (once per step)": t for g, t in self.step_exposed.items()},
                "optimizer": self.optimizer, "link_time": self.comm_seconds,
                "compute_per_step": {"matmul": self.microbatches * slow.matmul,
                                     "attention": self.microbatches * slow.attention,
                                     "memory_bound": self.microbatches * slow.memory,
                                     "host_transfer": self.microbatches * slow.transfer}}


def overlap_window(c: Collective, lay: Layout) -> str:
    """What compute can hide collective `c` under this layout's schedule (comm.py's default,
    changed where the layout turns an overlap on)."""
    if c.group == "tp" and lay.tp_overlap:
        return "matmul"
    if c.group == "ep" and lay.ep_overlap:
        return "microbatch"
    if c.group == "pp" and lay.pp_schedule in P2P_OVERLAP_SCHEDULES:
        return "microbatch"
    return c.overlap


def step_time(cfg: ModelConfig, lay: Layout, work: Workload, cluster: Cluster,
              collectives: list[list[Collective]], local_params: list[float],
              profile: ModelProfile | None = None, activation_dtype: str = "bf16",
              offloaded: list[float] | None = None) -> StepTime:
    """Estimated seconds of one step. `collectives[s]` and `local_params[s]` (parameters a rank of
    stage s updates, after ZeRO sharding) come from comm.py and memory.py; `offloaded[s]` is the
    bytes of one micro-batch stage s offloads to host memory (activations.py)."""
    profile = profile or ModelProfile.of(cfg, work.seq_len)
    m = lay.microbatches(work)
    stages: list[StageTime] = []
    step_exposed: dict[str, float] = {}
    comm_seconds: dict[str, float] = {}
    for s, colls in enumerate(collectives):
        c_time = stage_compute_time(cfg, lay, work, s, cluster, profile, activation_dtype,
                                    offloaded[s] if offloaded else 0.0)
        st = StageTime(stage=s, compute=c_time.total, attention=c_time.attention, matmul=c_time.matmul,
                       memory=c_time.memory, transfer=c_time.transfer)
        hidden_by_mb: dict[str, float] = {}
        hidden_by_matmul: dict[str, float] = {}
        link: dict[str, float] = {}
        once: dict[str, dict[str, float]] = {"last_backward": {}, "first_forward": {}}
        for c in colls:
            per_call = cluster.collective_time(c.bytes_per_call(), c.group_size, c.stride)
            mb_time, step_t = per_call * c.calls_per_microbatch, per_call * c.calls_per_step
            link[c.group] = link.get(c.group, 0.0) + mb_time * m + step_t
            window = overlap_window(c, lay)
            if window == "none":
                st.exposed[c.group] = st.exposed.get(c.group, 0.0) + mb_time
            elif window == "attention":
                st.exposed[c.group] = st.exposed.get(c.group, 0.0) + max(0.0, mb_time - st.attention)
            elif window == "matmul":
                hidden_by_matmul[c.group] = hidden_by_matmul.get(c.group, 0.0) + mb_time
            elif window == "microbatch":
                hidden_by_mb[c.group] = hidden_by_mb.get(c.group, 0.0) + mb_time
            if step_t > 0:
                bucket = once["first_forward" if c.overlap == "first_forward" else "last_backward"]
                bucket[c.group] = bucket.get(c.group, 0.0) + step_t
        for group, t in link.items():
            comm_seconds[group] = max(comm_seconds.get(group, 0.0), t)
        # Collectives sharing a window share it: what exceeds the window is exposed, split between
        # the groups in proportion to their time.
        for hidden, window_time in ((hidden_by_matmul, st.matmul), (hidden_by_mb, st.compute)):
            total = sum(hidden.values())
            over = max(0.0, total - window_time)
            for group, t in hidden.items() if over > 0 else ():
                st.exposed[group] = st.exposed.get(group, 0.0) + over * t / total
        windows = {"last_backward": st.compute * 2 / 3, "first_forward": st.compute / 3}
        for kind, groups in once.items():
            budget = windows[kind]
            for group, t in sorted(groups.items()):
                hidden = min(t, budget)
                budget -= hidden
                if t - hidden > 0:
                    step_exposed[group] = max(step_exposed.get(group, 0.0), t - hidden)
        stages.append(st)
    slowest = max(st.per_microbatch for st in stages)
    bubble = bubble_fraction(lay.pp_schedule, lay.pp, m, lay.vpp)
    optimizer = max(local_params) * OPTIMIZER_BYTES_PER_PARAM / cluster.memory_bandwidth
    return StepTime(stages=stages, microbatches=m, bubble=bubble, pipeline=m * slowest * (1 + bubble),
                    step_exposed=step_exposed, optimizer=optimizer, comm_seconds=comm_seconds)
