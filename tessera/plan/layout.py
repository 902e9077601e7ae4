"""A resolved parallel layout and the work it carries, with every divisibility rule in one place.

Rank order (docs/architecture.md, "Rank order"): world = pp x dp_replicate x dp_shard x cp x tp, tp
innermost. Dense weights are cut by tp (heads, FFN columns, vocabulary) and pp (layers), then
sharded by ZeRO over dp_shard x cp and replicated over dp_replicate. Experts are split over ep
(which divides dp_shard x cp), cut by tp like the dense FFN (expert TP = TP), and sharded by ZeRO
over the remaining dp_shard x cp / ep ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.config.errors import ConfigError, ParallelError
from tessera.config.layout_rules import LayoutSizes, pipeline_microbatch_problem
from tessera.config.layout_rules import layout_problems as rule_problems
from tessera.config.model import ModelConfig
from tessera.config.parallel import TORCHTITAN_SAVE, ParallelConfig

# The trainer's V-shaped schedules (tessera/parallel/pipeline.py) as the planner names their bubbles
# (bubble.py): ZB-V, and DualPipeV, which has DualPipe's bubble and in-flight micro-batches with the
# parameters held once (what the planner counts for "dualpipe" too).
PLANNED_AS = {"zbv": "zb_v", "dualpipev": "dualpipe"}


def pairs_overlap(par: ParallelConfig) -> bool:
    """Whether the trainer runs DualPipeV's paired forward and backward at once (the rule of
    tessera/parallel/pipeline_overlap.py's `overlaps`, which needs torch; kept equal by a test)."""
    return par.pp_schedule == "dualpipev" and par.pp_overlap and par.tp == 1 and par.cp == 1


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes: sequences of `seq_len` tokens, `micro_batch` of them per
    forward pass on one data-parallel rank, `global_batch` in all."""

    seq_len: int
    micro_batch: int
    global_batch: int

    def __post_init__(self) -> None:
        for key in ("seq_len", "micro_batch", "global_batch"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ParallelError(f"{key}={v!r} is invalid: must be an integer >= 1")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True)
class Layout(LayoutSizes):
    """Sizes of every mesh dimension (the layout rules' `LayoutSizes`, dp_shard resolved) plus the
    memory/time trade-offs."""

    pp_schedule: str = "1f1b"
    zero_stage: int = 3
    recompute: str = "none"
    recompute_interval: int = 1
    recompute_save: tuple[str, ...] = TORCHTITAN_SAVE  # recompute=op: what is kept
    activation_offload: bool = False  # saved activations of the blocks in host memory
    activation_fp8: tuple[str, ...] = ()  # recompute=op: kept outputs stored in FP8
    optimizer: str = "fsdp"  # who shards the optimizer state: FSDP2 (zero_stage) or the distributed optimizer
    ep_dispatch_dtype: str = "input"  # the dtype the MoE dispatch sends its rows in (parallel.ep_dispatch_dtype)
    # Overlaps the planner can assume (not parallel.* keys: they describe the kernels and schedule).
    tp_overlap: bool = False  # TP/SP collectives overlapped with the layer's GEMMs (comm-GEMM overlap)
    ep_overlap: bool = False  # EP all-to-all hidden behind another micro-batch (DualPipe, 1F1B A2A overlap)
    fused_attention: bool = True  # flash-style attention core (False: s x s scores in memory, older runs)
    # Where the blocks run, for what autograd keeps: cuda (every SDPA core a fused kernel) or cpu, whose SDPA takes
    # its math kernel, which keeps the s x s probabilities, where the value head size differs from the query's (MLA)
    device: str = "cuda"

    @classmethod
    def from_parallel(cls, par: ParallelConfig, world: int) -> Layout:
        """The layout of `par` on `world` ranks; the trainer's DualPipeV with its pairs overlapped
        (`parallel.pp_overlap` where tp = cp = 1: tessera/parallel/pipeline_overlap.py) hides the
        expert all-to-all behind the paired micro-batch, so `ep_overlap` is on for it."""
        try:
            dp_shard = par.resolved_dp_shard(world)
        except ConfigError as e:  # same message, typed as a layout error
            raise ParallelError(str(e)) from e
        return cls(tp=par.tp, sp=par.sp, pp=par.pp, vpp=par.vpp,
                   pp_schedule=PLANNED_AS.get(par.pp_schedule, par.pp_schedule),
                   dp_replicate=par.dp_replicate, dp_shard=dp_shard, cp=par.cp, ep=par.ep,
                   cp_method=par.cp_method, zero_stage=par.zero_stage, recompute=par.recompute,
                   recompute_interval=par.recompute_interval, recompute_save=tuple(par.recompute_save),
                   activation_offload=par.activation_offload, activation_fp8=tuple(par.activation_fp8),
                   optimizer=par.optimizer, ep_overlap=pairs_overlap(par), ep_dispatch_dtype=par.ep_dispatch_dtype)

    def to_parallel(self, microbatches: int | None = None) -> ParallelConfig:
        return ParallelConfig(**self.parallel_settings(), microbatches=microbatches)

    def parallel_settings(self) -> dict:
        """The `parallel.*` keys of this layout, as `tessera train --set parallel.K=V` takes them."""
        fields = {f.name for f in dataclasses.fields(ParallelConfig)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items() if k in fields}

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different micro-batches are processed side by side."""
        return self.dp_replicate * self.dp_shard

    @property
    def dense_shard(self) -> int:
        """Ranks a dense parameter is ZeRO-sharded over (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def expert_shard(self) -> int:
        """Ranks an expert parameter is ZeRO-sharded over (dp_shard x cp / ep)."""
        return self.dp_shard * self.cp // self.ep

    def microbatches(self, work: Workload) -> int:
        """Micro-batches per step on each data-parallel rank (the pipeline's m)."""
        return work.global_batch // (work.micro_batch * self.dp)

    def describe(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else ""), f"pp{self.pp}"]
        if self.pp > 1:
            parts[-1] += f"({self.pp_schedule}" + (f",v{self.vpp})" if self.vpp > 1 else ")")
        if self.dp_replicate > 1:
            parts.append(f"rep{self.dp_replicate}")
        parts.append(f"shard{self.dp_shard}" + (f"(zero{self.zero_stage})" if self.optimizer == "fsdp"
                                                 else "(distributed optimizer)"))
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + (f"({self.cp_method})" if self.cp_method != "alltoall" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.tp_overlap:
            parts.append("tp-overlap")
        if self.ep_overlap:
            parts.append("a2a-overlap")
        parts.append(f"recompute={self.recompute_label()}")
        if self.activation_offload:
            parts.append("offload")
        return " ".join(parts)

    def recompute_label(self) -> str:
        """The policy in a few characters: op with its save list (`op` alone: torchtitan's) and FP8
        roles, `/k` for an interval."""
        label = self.recompute
        if self.recompute == "op":
            if self.recompute_save != TORCHTITAN_SAVE:
                label += "[" + ",".join(self.recompute_save) + "]"
            if self.activation_fp8:
                label += "+fp8[" + ",".join(self.activation_fp8) + "]"
        if self.recompute != "none" and self.recompute_interval > 1:
            label += f"/{self.recompute_interval}"
        return label

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def layout_problems(cfg: ModelConfig, lay: Layout, work: Workload, *, even_layers: bool = False) -> list[str]:
    """Every reason this layout cannot run this model and workload (empty when it can).

    The model rules are the trainer's (`tessera.config.layout_rules`); the batch rules are those
    of the trainer's start-up check (global batch in equal micro-batches over the data-parallel
    ranks, a micro-batch count the pipeline schedule accepts). `even_layers` also asks pp x vpp
    to divide the layer count (the search does; a given layout may split unevenly).
    """
    problems = rule_problems(cfg, lay, seq_len=work.seq_len)

    def need(cond: bool, message: str) -> None:
        if not cond:
            problems.append(message)

    chunks = lay.pp * lay.vpp
    if even_layers:
        need(cfg.n_layers % chunks == 0, f"pp x vpp = {chunks} does not divide n_layers={cfg.n_layers}")
    need(lay.vpp == 1 or lay.pp_schedule == "interleaved_1f1b", "vpp > 1 needs pp_schedule=interleaved_1f1b")
    step = work.micro_batch * lay.dp
    need(work.global_batch % step == 0,
         f"global_batch={work.global_batch} is not a multiple of micro_batch x dp = "
         f"{work.micro_batch} x {lay.dp} = {step}")
    if work.global_batch % step == 0:
        problem = pipeline_microbatch_problem(lay.pp_schedule, work.global_batch // step, lay.pp)
        if problem:
            problems.append(problem)
    need(work.seq_len <= cfg.max_seq_len, f"seq_len={work.seq_len} exceeds model max_seq_len={cfg.max_seq_len}")
    return problems


def check_layout(cfg: ModelConfig, lay: Layout, work: Workload) -> None:
    """Raise ParallelError naming every dimension that does not divide."""
    problems = layout_problems(cfg, lay, work)
    if problems:
        raise ParallelError("the layout cannot run this model: " + "; ".join(problems))


def stage_layers(n_layers: int, pp: int, vpp: int = 1) -> list[list[int]]:
    """Layer indices held by each pipeline rank: pp x vpp contiguous chunks as even as possible
    (earlier chunks take the remainder), chunk c on rank c mod pp (interleaved placement)."""
    chunks = pp * vpp
    base, extra = divmod(n_layers, chunks)
    out: list[list[int]] = [[] for _ in range(pp)]
    start = 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        out[c % pp].extend(range(start, start + size))
        start += size
    return out
