"""Pipeline parallelism: cut the model into stages of consecutive layers and run a schedule
(torch.distributed.pipelining) over micro-batches.

Stages. With pp ranks and vpp virtual stages per rank there are S = pp x vpp stages; stage s
holds a contiguous run of layers (`stage_layer_ids`, earlier stages take the remainder) and rank
r holds stages r, r + pp, r + 2 pp, ... (the looped placement of interleaved 1F1B, Narayanan et
al. 2021). A stage is the Transformer with the layers it does not own deleted (names of the rest
unchanged: `layers` is keyed by layer index), `tok_embeddings` only on stage 0 and `norm` /
`output` only on stage S-1; a stage without the head passes its hidden states on. The schedule
calls a stage with one tensor, token ids on stage 0 and hidden states on the others, and the step's
keyword arguments: a forward pre-hook turns them into the decoder's `ModelInput`. With tied
embeddings stage S-1 keeps `tok_embeddings` too, as its head's weight (tied_embeddings.py). A
vision-language model (tessera.models.vision.llava) is cut in its `language_model` the same way, and its
image side (the tower and projector: every other child) is kept on stage 0 only, which encodes the
micro-batch's images given to it as keyword arguments; every stage keeps the model's parameter
names.

Schedules: "gpipe" (Huang et al. 2019: all forwards, then all backwards), "1f1b" (PipeDream-
Flush, Narayanan et al. 2021: warm-up, steady one-forward-one-backward, cool-down),
"interleaved_1f1b" (vpp > 1 stages per rank shrink the bubble by vpp), "zero_bubble" (Qi et al.
2023: backward split into input- and weight-gradient passes that fill the bubble), and the two with
two stages per rank placed in a V (rank r holds stages r and 2 pp - 1 - r, so the first and the last
stage share rank 0): "zbv" (ZB-V, Qi et al. 2024) and "dualpipev" (DeepSeek-V3's DualPipe, arXiv
2412.19437, in its V-shaped variant: forward and backward micro-batches paired in the steady state;
with `parallel.pp_overlap` (the default) and tp = cp = 1 each pair's forward and backward run at once,
so that one's expert all-to-all hides behind the other's compute: pipeline_overlap.py; else one after
the other, torch's default). The V placement refuses tied embeddings (tied_embeddings.py pairs the
first and last stage across ranks).

Losses (numerics contract): the last stage's loss of micro-batch m is its token-loss sum / N of
the global batch; MoE auxiliary losses of every stage enter backward with weight 1/M (M = micro-
batches of the global batch, over all data-parallel ranks) by riding on the stage's output
(`AttachAuxLoss`, as Megatron-Core's MoEAuxLossAutoScaler); under fp16 loss scaling the
auxiliary loss first passes `aux_grad_scale`, which multiplies its gradient by the loss scale (the
loss function returns the stage's loss scaled the same way). Gradients are not rescaled by the schedule
(`scale_grads=False`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from tessera.config.errors import ConfigError, ParallelError
from tessera.config.layout_rules import ROUND_SCHEDULES
from tessera.config.parallel import V_SCHEDULES, ParallelConfig, stages_per_rank
from tessera.models.model_input import ModelInput
from tessera.parallel.dims import ParallelDims
from tessera.parallel.pipeline_overlap import overlap_pairs, overlaps

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble", *V_SCHEDULES)


def schedule_accepts_microbatches(schedule: str, microbatches: int, pp: int) -> bool:
    """Whether torch's `schedule` takes `microbatches` per step over `pp` pipeline ranks.

    1F1B and the interleaved schedules need one micro-batch per stage rank (m >= pp; GPipe takes
    any m). The interleaved ones also run max(1, m // pp) rounds of equal size, so m must be a
    multiple of m // pp: every m in [pp, 2 pp), then 2 pp, 2 pp + 2, ..., 3 pp, 3 pp + 3, ... (torch
    raises a bare ValueError otherwise, after the model is built)."""
    if schedule == "gpipe":
        return True
    if schedule == "dualpipev":  # one micro-batch per stage at least: 2 pp
        return microbatches >= 2 * pp
    if microbatches < pp:
        return False
    if schedule in ROUND_SCHEDULES:
        return microbatches % max(1, microbatches // pp) == 0
    return True


def stage_layer_ids(n_layers: int, num_stages: int) -> list[list[int]]:
    """Consecutive layer ids of every stage; the first n_layers % num_stages stages get one more."""
    if not 1 <= num_stages <= n_layers:
        raise ParallelError(f"{num_stages} pipeline stages cannot split model.n_layers={n_layers}: "
                            "every stage needs at least one layer")
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def stages_of_rank(pp_rank: int, pp: int, vpp: int, schedule: str = "1f1b") -> list[int]:
    """The stages rank `pp_rank` holds: looped (r, r + pp, ...), or in a V (r, 2 pp - 1 - r) for
    the V_SCHEDULES, which hold two stages per rank whatever vpp says."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(vpp)]


class AttachAuxLoss(torch.autograd.Function):
    """Forward: h unchanged. Backward: h's gradient, and gradient 1 for the (pre-scaled)
    auxiliary loss, so it is minimised although it is not part of the pipeline's output.

    The output shares h's storage (and version counter) without being an autograd view: it is
    what the FSDP-wrapped stage returns, and FSDP2 warns about views there (an in-place op on one
    would skip the pre-backward all-gather)."""

    @staticmethod
    def forward(ctx, h, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return h.detach()

    @staticmethod
    def backward(ctx, g):
        return g, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=g.device)


def _pass_hidden_states(h_BSD: torch.Tensor) -> torch.Tensor:
    return h_BSD


def _stage_input(first: bool, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A decoder stage's `ModelInput` from what the schedule hands it: `stage(x, **model_kwargs)`,
    `x` the token ids on the first stage and the previous stage's hidden states on the others, the
    keyword arguments its fields (multi-token prediction's on the last stage). A `ModelInput` given
    whole passes as it is (a companion stage run beside this one: pipeline_companion.py)."""
    (x,) = args
    if isinstance(x, ModelInput):
        return None
    return (ModelInput(tokens=x, **kwargs) if first else ModelInput(hidden=x, **kwargs),), {}


def language_model(model: nn.Module) -> nn.Module:
    """The decoder a pipeline cuts: `model` itself, or a vision-language model's `language_model`."""
    return getattr(model, "language_model", model)


def split_stage(model: nn.Module, stage: int, num_stages: int, aux_scale: float,
                aux_grad_scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """Turn `model` (in place) into pipeline stage `stage`: keep its layers, drop the rest, and
    make its forward return one tensor (hidden states, or logits on the last stage).
    `aux_grad_scale` (fp16 loss scaling) takes the auxiliary loss before it is weighted. A
    vision-language model is cut in its language model; its image side stays on stage 0 only."""
    lm = language_model(model)
    owned = stage_layer_ids(len(lm.layers), num_stages)[stage]
    for key in list(lm.layers.keys()):
        if int(key) not in owned:
            del lm.layers[key]
    # The last stage embeds too with tied embeddings (its head) or multi-token prediction (its modules).
    embeds_last = lm.cfg.tie_embeddings or getattr(lm, "mtp", None) is not None
    if stage != 0 and not (embeds_last and stage == num_stages - 1):
        lm.tok_embeddings = None
    if stage != 0 and lm is not model:  # the tower and projector: the first stage's
        for name, _ in list(model.named_children()):
            if name != "language_model":
                setattr(model, name, None)
    if stage != num_stages - 1:
        lm.norm = None
        lm.output = None
        lm.mtp = None
        lm.lm_head = _pass_hidden_states  # no head here: hidden states go to the next stage

    def stage_output(module, args, out):
        scale = aux_grad_scale if aux_grad_scale is not None else (lambda loss: loss)
        aux = scale(out.aux_loss) * aux_scale
        if getattr(out, "mtp_objective", None) is not None:  # multi-token prediction's loss / N
            aux = aux + scale(out.mtp_objective)
        return AttachAuxLoss.apply(out.logits, aux) if aux.requires_grad else out.logits

    model.register_forward_hook(stage_output)
    if lm is model:  # a vision-language model's forward takes the schedule's arguments itself
        model.register_forward_pre_hook(partial(_stage_input, stage == 0), with_kwargs=True)
    model.pipeline_stage = (stage, num_stages)
    return model


@dataclass
class PipelineRun:
    """What `build_pipeline` returns: this rank's stage modules (to optimise and checkpoint) and
    the schedule that runs one step."""

    schedule: object
    modules: list[nn.Module]
    stage_ids: list[int]
    num_stages: int
    losses: list[torch.Tensor] = field(default_factory=list)
    eval_schedule: object | None = None  # the forward-only one where `schedule.eval` cannot run (V schedules)
    overlapped: object | None = None  # DualPipeV's overlapped pairs (pipeline_overlap.OverlappedPairs), if on

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs) -> list[torch.Tensor]:
        """Forward and backward of this rank's part of the batch (cut into micro-batches by the
        schedule); returns the last stage's per-micro-batch losses (empty elsewhere).
        `model_kwargs` reach every stage's forward, tensors cut into the same micro-batches
        (multi-token prediction's token ids and targets on the last stage)."""
        return self._run(self.schedule.step, inputs, targets, **model_kwargs)

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs) -> list[torch.Tensor]:
        """Forward only (the schedule's eval): the last stage's per-micro-batch losses, no gradients;
        `model_kwargs` as in `step`."""
        return self._run((self.eval_schedule or self.schedule).eval, inputs, targets, **model_kwargs)

    def _run(self, call: Callable, inputs: torch.Tensor, targets: torch.Tensor, **kw) -> list[torch.Tensor]:
        # A batch's inputs and targets are views of one [B, seq + 1] token tensor (row stride seq + 1);
        # torch 2.11's stages check each micro-batch's strides against the contiguous ones they expect.
        inputs, targets = inputs.contiguous(), targets.contiguous()
        losses: list[torch.Tensor] = []
        if self.has_first_stage and self.has_last_stage:
            call(inputs, target=targets, losses=losses, **kw)
        elif self.has_first_stage:
            call(inputs, **kw)
        elif self.has_last_stage:
            call(target=targets, losses=losses, **kw)
        else:
            call(**kw)
        return losses


def rank_stage_modules(model: nn.Module, dims: ParallelDims, vpp: int, aux_scale: float,
                       parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
                       aux_grad_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       schedule: str = "1f1b") -> tuple[list[int], list[nn.Module]]:
    """This rank's stage ids and stage modules: `model` split (the last stage in place, the others
    from copies) and each parallelized by `parallelize_stage`. The mesh must exist."""
    num_stages = dims.pp * stages_per_rank(schedule, vpp)
    stage_ids = stages_of_rank(dims.local_rank("pp"), dims.pp, vpp, schedule)
    modules = []
    for i, s in enumerate(stage_ids):
        m = split_stage(model if i == len(stage_ids) - 1 else copy.deepcopy(model), s, num_stages, aux_scale,
                        aux_grad_scale)
        modules.append(parallelize_stage(m) if parallelize_stage is not None else m)
    return stage_ids, modules


def _refuse_v_placement(cfg: ParallelConfig, model_cfg) -> None:
    """The V schedules hold two stages per rank (vpp stays 1) and put the first and the last stage on
    rank 0, which the tied embedding's cross-rank pairing (tied_embeddings.py) does not handle."""
    if cfg.pp_schedule not in V_SCHEDULES:
        return
    if cfg.vpp != 1:
        raise ConfigError(f"parallel.vpp={cfg.vpp} is invalid with parallel.pp_schedule={cfg.pp_schedule}: the "
                          "schedule holds two stages per rank by itself; leave vpp at 1")
    if model_cfg.tie_embeddings or model_cfg.mtp_depth:
        raise ConfigError(f"parallel.pp_schedule={cfg.pp_schedule} is not available for a model with tied embeddings "
                          "or multi-token prediction (model.tie_embeddings, model.mtp_depth): the first and last "
                          "stage share rank 0; use 1f1b, interleaved_1f1b or zero_bubble")


SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")  # torch runs some backwards as input, then weight passes


def _refuse_split_backward_under_fsdp(schedule: str, modules: list[nn.Module]) -> None:
    """torch's split backward (the weight pass of zero_bubble, zbv and dualpipev's warm-up) does not reach
    FSDP2's unsharded parameters: on gloo the weight gradients came out missing (zbv, zero_bubble) or
    short of those micro-batches (dualpipev's last stage, 40% off). Refused until it does."""
    if schedule in SPLIT_BACKWARD and any(isinstance(m, FSDPModule) for m in modules):
        raise ConfigError(f"parallel.pp_schedule={schedule} is invalid with FSDP stages (parallel.optimizer=fsdp "
                          "with dp_replicate x dp_shard x cp > 1 or bf16 parameters): its split input / weight "
                          "backward loses FSDP2's weight gradients; use parallel.optimizer=distributed, or "
                          "pp_schedule 1f1b or interleaved_1f1b")


def build_pipeline(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], aux_scale: float,
                   parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
                   device: torch.device | str = "cpu",
                   aux_grad_scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PipelineRun:
    """Split the full `model` into this rank's stages, parallelize each (TP/EP/AC/FSDP through
    `parallelize_stage`, e.g. `lambda m: parallelize(m, dims, cfg)`), and build the schedule.

    `loss_fn(logits, targets)` is one micro-batch's loss (token-loss sum / global loss tokens);
    `aux_scale` the weight of a micro-batch's MoE auxiliary loss (1 / micro-batches of the global
    batch); `aux_grad_scale` what fp16 loss scaling applies to that loss first (the loss function
    scales its own)."""
    if cfg.pp_schedule not in SCHEDULES:
        raise ParallelError(f"pp_schedule={cfg.pp_schedule!r} is invalid: one of {', '.join(SCHEDULES)}")
    if cfg.vpp > 1 and cfg.pp_schedule not in MULTI_STAGE:
        raise ParallelError(f"vpp={cfg.vpp} needs a multi-stage schedule ({', '.join(MULTI_STAGE)}), "
                            f"not {cfg.pp_schedule}")
    if not schedule_accepts_microbatches(cfg.pp_schedule, microbatches, dims.pp):
        fits = [m for m in range(1, 4 * dims.pp + 1) if schedule_accepts_microbatches(cfg.pp_schedule, m, dims.pp)]
        raise ConfigError(f"parallel.microbatches={microbatches} is invalid for parallel.pp_schedule="
                          f"{cfg.pp_schedule} with parallel.pp={dims.pp}: the schedule needs at least one "
                          "micro-batch per stage rank (m >= pp) and, interleaved, m // pp rounds of equal size "
                          f"(m a multiple of m // pp); allowed up to {4 * dims.pp}: {fits}")
    _refuse_v_placement(cfg, language_model(model).cfg)
    per_rank = cfg.stages_per_rank
    dims.validate(language_model(model).cfg, dims.world_size, vpp=per_rank)
    if dims.mesh is None:
        dims.build_mesh(str(device).split(":")[0])
    num_stages = dims.pp * per_rank
    stage_ids, modules = rank_stage_modules(model, dims, cfg.vpp, aux_scale, parallelize_stage, aux_grad_scale,
                                            cfg.pp_schedule)
    _refuse_split_backward_under_fsdp(cfg.pp_schedule, modules)
    group = dims["pp"].get_group()
    stages = [PipelineStage(m, s, num_stages, torch.device(device), group=group)
              for s, m in zip(stage_ids, modules, strict=True)]
    cls = SCHEDULES[cfg.pp_schedule]
    stage_arg = stages if cfg.pp_schedule in MULTI_STAGE else stages[0]
    schedule = cls(stage_arg, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    evaluation = _v_forward_only(stages, microbatches, loss_fn) if cfg.pp_schedule in V_SCHEDULES else None
    pairs = (overlap_pairs(schedule, dims) if cfg.pp_schedule == "dualpipev" and cfg.pp_overlap and overlaps(dims)
             else None)
    return PipelineRun(schedule, modules, stage_ids, num_stages, eval_schedule=evaluation, overlapped=pairs)


def _v_forward_only(stages: list[PipelineStage], microbatches: int, loss_fn: Callable) -> object:
    """A forward-only schedule over the V placement, for evaluation: torch's ZB-V and DualPipeV keep
    their backward actions under `eval` and fail there, and its schedule check demands a backward per
    forward. Each micro-batch goes through the stages in order; torch's own lowering adds the FSDP
    unshards and the sends and receives (the private helpers its V schedules are built with)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    runtime = torch_schedules._PipelineScheduleRuntime(  # noqa: SLF001
        stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    pp = stages[0].group_size
    rank_of = {s: s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)}
    actions: dict[int, list] = {r: [] for r in range(pp)}
    for mb in range(microbatches):
        for s in range(2 * pp):
            actions[rank_of[s]].append(torch_schedules._Action(s, torch_schedules.FORWARD, mb))  # noqa: SLF001
    runtime.stage_index_to_group_rank = rank_of
    for stage in stages:
        stage.stage_index_to_group_rank = rank_of
    lowered = {r: torch_schedules._add_unshard_reshard(a) for r, a in actions.items()}  # noqa: SLF001
    runtime.pipeline_order_with_comms = torch_schedules._add_send_recv(  # noqa: SLF001
        lowered, stage_to_rank=rank_of.__getitem__, num_stages=2 * pp)
    return runtime
