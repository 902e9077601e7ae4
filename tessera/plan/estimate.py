"""One plan: parameters, memory per rank by part, FLOPs, bubble, communication and step time of a
model x layout x workload x cluster. Everything else in this folder feeds `make_plan`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.config.dtypes import short_dtype_argument
from tessera.config.errors import ConfigError, ParallelError
from tessera.config.model import ModelConfig
from tessera.models.counting import embedding_params
from tessera.models.flops import (
    attention_core_flops_per_token,
    flops_per_token,
    layer_forward_flops_per_token,
    recompute_flops_per_token,
    six_nd,
)
from tessera.plan.activation_dtypes import get_activation_dtype
from tessera.plan.activations import StageActivations, stage_activations
from tessera.plan.bubble import bubble_table, layer_replays
from tessera.plan.cluster import Cluster
from tessera.plan.comm import Collective, stage_collectives
from tessera.plan.layout import Layout, Workload, layout_problems
from tessera.plan.memory import (
    ModelStateBytes,
    RankParams,
    get_precision,
    model_state_bytes,
    rank_params,
    sharding_choices,
    teacher_stage_bytes,
)
from tessera.plan.profile import ModelProfile, handoff_flops, layer_mixer
from tessera.plan.roofline import StepTime, step_time
from tessera.plan.saved.recompute_terms import product_flops_per_token, recomputed_products
from tessera.plan.saved.saved_terms import sdpa_core

# fp16 (autocast over fp32 weights, loss-scaled) keeps the same bytes as bf16: 2-byte compute copies.
TRAIN_DTYPES = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "autocast-bf16"), "fp16": ("bf16", "autocast-bf16")}


def precisions_for_train_dtype(dtype: str) -> tuple[str, str]:
    """(model-state precision, activation dtype) for `train.dtype`: the trainer runs bf16 as autocast
    over fp32 parameters."""
    dtype = short_dtype_argument(dtype)  # bfloat16 is bf16 (tessera.config.dtypes)
    if dtype not in TRAIN_DTYPES:
        raise ConfigError(f"train.dtype={dtype!r} is invalid: one of {', '.join(TRAIN_DTYPES)}")
    return TRAIN_DTYPES[dtype]


@dataclass
class StageMemory:
    stage: int
    params: RankParams
    states: ModelStateBytes
    activations: StageActivations
    teacher: float = 0.0  # a distillation teacher's frozen weights on this rank (memory.teacher_weight_bytes)

    @property
    def total(self) -> float:
        return self.states.total + self.activations.total + self.teacher


@dataclass
class Plan:
    model: ModelConfig
    layout: Layout
    work: Workload
    cluster: Cluster
    precision: str
    activation_dtype: str
    params_total: int
    params_active: int
    stages: list[StageMemory]
    collectives: list[list[Collective]]
    time: StepTime
    model_flops_per_step: float
    hardware_flops_per_step: float
    teacher: ModelConfig | None = None  # train.distill.teacher's model

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches(self.work)

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.cluster.usable_memory

    @property
    def tokens_per_second(self) -> float:
        return self.work.tokens / self.time.total

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.time.total * self.layout.world * self.cluster.gpu_flops)

    def as_dict(self) -> dict:
        peak = self.peak
        return {
            "model": {"params_total": self.params_total, "params_active": self.params_active,
                      "params_embedding": embedding_params(self.model), "is_moe": self.model.is_moe},
            "layout": self.layout.as_dict() | {"describe": self.layout.describe(), "world": self.layout.world,
                                               "microbatches": self.microbatches},
            "workload": {"seq_len": self.work.seq_len, "micro_batch": self.work.micro_batch,
                         "global_batch": self.work.global_batch, "tokens_per_step": self.work.tokens},
            "cluster": dataclasses.asdict(self.cluster),
            "precision": self.precision, "activation_dtype": self.activation_dtype,
            "memory": {"peak_stage": peak.stage, "peak_bytes": peak.total, "usable_bytes": self.cluster.usable_memory,
                       "fits": self.fits,
                       "stages": [{"stage": s.stage, "params_dense": s.params.dense, "params_expert": s.params.expert,
                                   "model_states": s.states.as_dict(), "activations": s.activations.as_dict(),
                                   **({"teacher_weights": s.teacher} if self.teacher is not None else {}),
                                   "total": s.total} for s in self.stages],
                       "sharding_choices": {k: v.as_dict() for k, v in sharding_choices(
                           peak.params, self.layout, get_precision(self.precision), self.microbatches).items()}},
            "flops": {"model_per_step": self.model_flops_per_step, "hardware_per_step": self.hardware_flops_per_step,
                      "model_per_token": self.model_flops_per_step / self.work.tokens,
                      "six_n_active_d": six_nd(self.params_active, self.work.tokens)},
            "pipeline": {"bubble_fraction": self.time.bubble,
                         "schedules": bubble_table(self.layout.pp, self.microbatches, max(self.layout.vpp, 2))},
            "communication": [c.as_dict(self.microbatches) for c in self.collectives[peak.stage]],
            "time": self.time.as_dict() | {"tokens_per_second": self.tokens_per_second, "mfu": self.mfu},
        }


def recompute_flops(cfg: ModelConfig, lay: Layout, work: Workload, dtype: str) -> float:
    """Forward FLOPs per token the recomputation policy adds (the op policy's from its products and cores), each
    recomputed layer's as many times as the schedule replays it (bubble.py's `layer_replays`: more than
    once where torch splits the backward into input and weight passes)."""
    if lay.recompute not in ("full", "op"):
        return recompute_flops_per_token(cfg, work.seq_len, lay.recompute, interval=lay.recompute_interval)
    replays = layer_replays(cfg, lay.pp_schedule, lay.pp, lay.microbatches(work), lay.recompute, lay.vpp)
    layers = range(0, cfg.n_layers, lay.recompute_interval)
    if lay.recompute == "full":
        return sum(replays[i][1] * layer_forward_flops_per_token(cfg, i, work.seq_len) for i in layers)
    tokens = max(work.micro_batch * work.seq_len // lay.cp, 1)
    local = cfg.moe.num_experts // lay.ep if cfg.moe is not None else None

    def core(i: int) -> float:  # the attention core unless kept; a recurrent core (or none) always re-runs
        kept = "attention_core" in lay.recompute_save and sdpa_core(cfg, i)  # (a sink core re-runs too)
        return 0.0 if kept else attention_core_flops_per_token(cfg, work.seq_len, layer=i)

    return sum(replays[i][1] * (core(i) + sum(product_flops_per_token(p) for p in recomputed_products(
        cfg, i, dtype, lay.recompute_save, lay.activation_fp8, tokens=tokens, local_experts=local)))
        for i in layers)


def handoff_flops_per_token(cfg: ModelConfig, lay: Layout, work: Workload) -> float:
    """Forward, input and weight gradients' FLOPs per token of the whole model that context parallelism
    adds to the recurrent layers (profile.py's `handoff_flops`: the rank's heads, so x tp; a micro-batch
    of seq_len / cp tokens a rank), with the forward again where full or op recomputation re-runs them."""
    if lay.cp == 1:
        return 0.0
    total = 0.0
    for i in range(cfg.n_layers):
        mixer = layer_mixer(cfg, i)
        if mixer in ("delta", "ssd"):
            again = 1 if lay.recompute in ("full", "op") and i % lay.recompute_interval == 0 else 0
            total += (3 + again) * handoff_flops(cfg, mixer, lay, work.micro_batch, work.seq_len)
    return total * lay.tp * lay.cp / (work.micro_batch * work.seq_len)


def make_plan(cfg: ModelConfig, lay: Layout, work: Workload, cluster: Cluster, *, precision: str = "bf16",
              activation_dtype: str = "autocast-bf16", even_layers: bool = False,
              profile: ModelProfile | None = None, teacher: ModelConfig | None = None, loss: str = "tessera"
              ) -> Plan:
    """The full estimate. Raises ParallelError naming every dimension that does not divide.
    `profile` (from `ModelProfile.of(cfg, work.seq_len)`) lets many plans of one model share work.
    `teacher` (train.distill.teacher's model) adds its frozen weights (and under pp its hidden
    states in flight) to every rank's memory. `loss`: the cross-entropy's implementation, whose
    buffers peak at the last stage (loss_memory.py)."""
    problems = layout_problems(cfg, lay, work, even_layers=even_layers)
    if teacher is not None and teacher.n_layers < lay.pp * lay.vpp:
        problems.append(f"the distillation teacher (train.distill.teacher) has {teacher.n_layers} layers, fewer "
                        f"than the {lay.pp * lay.vpp} pipeline stages it is cut into")
    if lay.world != cluster.gpus:
        problems.append(f"the layout uses {lay.world} ranks but the cluster has {cluster.gpus} GPUs")
    if problems:
        raise ParallelError("the layout cannot run this model: " + "; ".join(problems))
    prec = get_precision(precision)
    get_activation_dtype(activation_dtype)
    prof = profile if profile is not None and profile.seq_len == work.seq_len else ModelProfile.of(cfg, work.seq_len)
    params = rank_params(cfg, lay, prof)
    acts = stage_activations(cfg, lay, work, activation_dtype, prof, loss)
    m = lay.microbatches(work)
    held = [0.0 if teacher is None else teacher_stage_bytes(teacher, lay, work, prec, activation_dtype, s, a)
            for s, a in enumerate(acts)]
    stages = [StageMemory(s, p, model_state_bytes(p, lay, prec, m), a, held[s])
              for s, (p, a) in enumerate(zip(params, acts))]
    colls = [stage_collectives(cfg, lay, work, s, p, prec, activation_dtype, prof) for s, p in enumerate(params)]
    local = [p.dense / lay.dense_shard + p.expert / lay.expert_shard for p in params]
    offloaded = [a.offloaded / a.in_flight for a in acts]
    time = step_time(cfg, lay, work, cluster, colls, local, prof, activation_dtype, offloaded)
    model_flops = prof.memo(("model_flops",), lambda: flops_per_token(cfg, work.seq_len)) * work.tokens
    extra = prof.memo(("recompute_flops", lay.recompute, lay.recompute_interval, lay.recompute_save,
                       lay.activation_fp8, lay.ep, activation_dtype, lay.pp_schedule, lay.pp, lay.vpp, m),
                      lambda: recompute_flops(cfg, lay, work, activation_dtype))
    return Plan(model=cfg, layout=lay, work=work, cluster=cluster, precision=precision,
                activation_dtype=activation_dtype, params_total=prof.params_total,
                params_active=prof.params_active, stages=stages, collectives=colls, time=time,
                model_flops_per_step=model_flops,
                hardware_flops_per_step=model_flops + (extra + handoff_flops_per_token(cfg, lay, work)) * work.tokens,
                teacher=teacher)
