"""The builder: a config and a layout in, this rank's model parts, optimizers and loss scaler out,
finished, and the step engine that drives them.

    built = build_training_parts(cfg, layout, init_from, compile)   # TrainingParts
    engine = build_step_engine(cfg, layout, built)                   # a StepEngine

The steps run in this order, which is part of the numerics (every layout starts from the weights
one process has, docs/architecture.md, "Numerics contract"):
1. the whole model: in one process allocated on the device and initialised from `train.seed`
   (unless `init_from` fills it); on ranks built on the meta device, with a second meta copy
   (`reference`) that names every tensor for initialisation by name;
2. train mode, the chunked LM-head loss (`train.loss_chunk_tokens`), the FP8 linear layers
   (`train.fp8`, before any parallelisation);
3. one process with `init_from`: its weights are read; then `train.lora` freezes the base and adds
   the adapters (tessera.train.lora), and `full_shapes` are the whole model's tensor shapes, what
   checkpoint loading checks against (`init_from` checks the base's); `train.indexer_loss` makes the
   sparse-attention indexers train (tessera.train.indexer_loss), all else frozen in its warm-up;
4. parallelisation: one process compiles each block (`train.compile`); pp = 1 layouts
   `parallelize` the model; pp > 1 layouts cut it into this rank's stages, parallelize each and
   build the schedule and the tied-embedding group (`Pipeline`). A vision-language model (built
   whole on every rank, never on the meta device) takes `parallelize_vision_language` instead,
   the same way (tessera.parallel.vision_language);
5. on ranks: this rank's storage is allocated and initialised by name from the seed
   (tessera.parallel.meta_init) or read from `init_from`, each rank only its shards;
6. the optimizers over the materialised parameters: AdamW per part, or with
   `parallel.optimizer=distributed` on ranks one DistributedOptimizer per part.
fp16 gets a DynamicLossScaler, which every engine applies where its loss is made (loss_scaler.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from tessera.config.errors import ParallelError
from tessera.config.schema import RunConfig
from tessera.models import Transformer
from tessera.models.float8 import convert_to_float8
from tessera.models.lora import init_adapters
from tessera.parallel import build_pipeline, parallelize
from tessera.parallel.compile import compile_blocks
from tessera.parallel.dims import ParallelDims
from tessera.parallel.distributed_optimizer import DistributedOptimizer
from tessera.parallel.memory.activation_checkpoint import apply_activation_checkpointing
from tessera.parallel.memory.activation_offload import apply_activation_offload
from tessera.parallel.meta_init import materialize_by_name
from tessera.parallel.pipeline import rank_stage_modules
from tessera.parallel.tied_embeddings import TiedEmbeddings
from tessera.parallel.vision_language import parallelize_vision_language
from tessera.train.indexer_loss import apply_indexer_loss
from tessera.train.init_from import load_initial_weights
from tessera.train.lora import apply_lora, holds_quantized_base, load_quantized_base
from tessera.train.objectives.distill_loss import Distiller
from tessera.train.optimizer import build_optimizers
from tessera.train.precision import autocast_dtype, loss_chunk_tokens
from tessera.train.run.layout import RunLayout
from tessera.train.steps.compute_weights import cast_weight_names
from tessera.train.steps.loss_scaler import DynamicLossScaler
from tessera.train.steps.parallel_step import ParallelStep
from tessera.train.steps.pipeline_step import Pipeline, PipelineLoss, PipelineStep, attach_teacher
from tessera.train.steps.single_process_step import SingleProcessStep
from tessera.train.steps.step_engine import StepEngine
from tessera.train.vision_language import build_vision_model, is_vision_run


@dataclass
class TrainingParts:
    """What `build_training_parts` hands to the step engine and the trainer, finished."""

    parts: list[nn.Module]  # the model in one process and at pp = 1; this rank's stages under pp
    optimizers: list[torch.optim.Optimizer | DistributedOptimizer]  # one per part
    loss_scaler: DynamicLossScaler | None  # fp16 only
    pipeline: Pipeline | None  # pp > 1: the schedule over `parts`
    full_shapes: dict[str, tuple[int, ...]]  # every tensor of the whole model (all stages)
    fp8_layers: list[nn.Module]  # the linear layers converted to FP8 (train.fp8)
    init_bytes_read: int  # bytes this rank read from init_from (0 without)
    autocast_dtype: torch.dtype | None  # the compute dtype (None: fp32)

    @property
    def distributed_optimizers(self) -> list[DistributedOptimizer]:
        """The optimizers that reduce gradients themselves (parallel.optimizer=distributed)."""
        return [o for o in self.optimizers if isinstance(o, DistributedOptimizer)]


def build_training_parts(cfg: RunConfig, layout: RunLayout, init_from: str | None,
                         compile: bool) -> TrainingParts:
    """This rank's model parts, optimizers and loss scaler (module docstring, steps 1-6).
    `init_from`: the weights to start from (None: from `train.seed`); `compile`: the resolved
    `train.compile` (tessera.parallel.compile.resolve_compile)."""
    t, on_ranks = cfg.train, layout.dims is not None
    compute_dtype = autocast_dtype(t.dtype)
    quantized = holds_quantized_base(cfg, on_ranks)  # QLoRA: built on the meta device, filled quantized
    model, reference = _whole_model(cfg, layout, init_from, meta=quantized)
    fp8_layers = convert_to_float8(model) if t.fp8 else []
    base_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # what init_from fills
    bytes_read = 0
    if quantized:
        bytes_read = load_quantized_base(model, cfg, init_from, layout.device)
    elif init_from is not None and not on_ranks and not is_vision_run(cfg):  # a LLaVA is read whole when built
        bytes_read = load_initial_weights([model], init_from, cfg.model, base_shapes, layout.device)
    apply_lora(model, reference, cfg, on_ranks)  # train.lora: the base frozen (quantized), adapters added
    apply_indexer_loss(model, reference, cfg)  # train.indexer_loss: the indexers train (alone in the warm-up)
    full_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    loss_scaler = DynamicLossScaler() if t.dtype == "fp16" else None
    parts, pipeline = _parallelized_parts(model, cfg, layout, compute_dtype, compile, loss_scaler)
    if on_ranks and not is_vision_run(cfg):  # a LLaVA is built whole on every rank, from the seed or read
        with layout.phase("initialising the weights"):
            if init_from is not None:
                bytes_read = load_initial_weights(parts, init_from, cfg.model, base_shapes, layout.device)
                init_adapters(parts, t.seed)  # train.lora's adapters, which the source does not hold
            else:
                materialize_by_name(parts, reference, t.seed, layout.device)
    optimizers = build_optimizers(parts, cfg, layout.dims, compute_dtype or torch.float32)
    return TrainingParts(parts, optimizers, loss_scaler, pipeline, full_shapes, fp8_layers, bytes_read,
                         compute_dtype)


def _whole_model(cfg: RunConfig, layout: RunLayout, init_from: str | None,
                 meta: bool = False) -> tuple[Transformer, Transformer | None]:
    """The whole model in train mode and, on ranks without `init_from`, the meta `reference` that
    names every tensor for `materialize_by_name`. `meta`: built on the meta device in one process too."""
    t, reference = cfg.train, None
    if is_vision_run(cfg):  # a LLaVA (tessera.train.vision_language), whole on every rank
        model = build_vision_model(cfg, layout.device, init_from)
        model.language_model.loss_chunk_tokens = loss_chunk_tokens(t.loss_chunk_tokens, layout.device)
        return model, None
    if layout.dims is not None or meta:
        with torch.device("meta"):
            model = Transformer(cfg.model, init_seed=None)
            reference = Transformer(cfg.model, init_seed=None) if init_from is None and not meta else None
    else:
        model = Transformer(cfg.model, init_seed=t.seed if init_from is None else None).to(layout.device)
    model.train()
    model.loss_chunk_tokens = loss_chunk_tokens(t.loss_chunk_tokens, layout.device)  # chunked LM-head loss
    return model, reference


def _parallelized_parts(model: Transformer, cfg: RunConfig, layout: RunLayout, compute_dtype: torch.dtype | None,
                        compile: bool, loss_scaler: DynamicLossScaler | None
                        ) -> tuple[list[nn.Module], Pipeline | None]:
    """`model` as this rank's parts: compiled in one process, parallelized at pp = 1, cut into
    parallelized stages with their schedule under pp."""
    dims = layout.dims
    if dims is None:  # parallelize's order, without the parallelisms
        p = cfg.parallel
        apply_activation_checkpointing(model, p.recompute, p.recompute_interval, save=p.recompute_save,
                                       fp8=p.activation_fp8)
        if compile:
            compile_blocks(model, compute_dtype)
        if p.activation_offload:
            apply_activation_offload(model, layout.device.type)
        return [model], None
    param_dtype = compute_dtype or torch.float32

    def parallelized(m: nn.Module) -> nn.Module:
        if is_vision_run(cfg):  # the language model's layouts, the image side beside it (first stage under pp)
            return parallelize_vision_language(m, dims, cfg.parallel, param_dtype=param_dtype,
                                               reduce_dtype=torch.float32, device_type=layout.device.type)
        return parallelize(m, dims, cfg.parallel, param_dtype=param_dtype, reduce_dtype=torch.float32,
                           device_type=layout.device.type, compile_blocks=compile)

    with layout.phase("parallelizing the model"):
        if dims.pp == 1:
            return [parallelized(model)], None
        pipeline = _pipeline(model, cfg, dims, layout.device, parallelized, loss_scaler)
        return list(pipeline.run.modules), pipeline


def _pipeline(model: Transformer, cfg: RunConfig, dims: ParallelDims, device: torch.device,
              parallelized: Callable[[nn.Module], nn.Module], loss_scaler: DynamicLossScaler | None) -> Pipeline:
    """This rank's stages of `model`, each `parallelized`, the schedule over them and the tied
    embedding's group. A rank's rows are cut into `parallel.microbatches` micro-batches (default
    rows / train.micro_batch_size); an auxiliary loss enters backward with weight 1 / (micro-batches
    over all data-parallel ranks)."""
    t = cfg.train
    microbatches = cfg.parallel.microbatches or t.global_batch_size // dims.dp_size // t.micro_batch_size
    loss = PipelineLoss(loss_scaler)
    run = build_pipeline(model, dims, cfg.parallel, microbatches, loss_fn=loss,
                         aux_scale=1.0 / (microbatches * dims.dp_size), parallelize_stage=parallelized,
                         device=device, aux_grad_scale=loss_scaler.scale_grad if loss_scaler is not None else None)
    # The first and last stage each hold the tied embedding (tessera.parallel.tied_embeddings); the
    # last one holds it too for multi-token prediction, which embeds the tokens i+k there.
    shared = cfg.model.tie_embeddings or cfg.model.mtp_depth > 0
    tied = TiedEmbeddings(list(run.modules), dims) if shared else None
    return Pipeline(run, loss, microbatches, tied)


def build_step_engine(cfg: RunConfig, layout: RunLayout, built: TrainingParts,
                      distiller: Distiller | None = None) -> StepEngine:
    """The engine of the layout, over the finished `built` parts; `distiller`: train.distill's teacher
    (under pp its stages are attached to the student's: pipeline_step.attach_teacher)."""
    t, dims = cfg.train, layout.dims
    if dims is None:
        return SingleProcessStep(built.parts[0], t.micro_batch_size, cfg.accumulation_steps(1), layout.device,
                                 built.autocast_dtype, t.cast_weights_per_step, built.loss_scaler, distiller)
    if built.pipeline is not None:
        if distiller is not None:  # the teacher's stages run beside the student's, in its schedule
            attach_teacher(built.pipeline, distiller, cfg.model.dim)
        return PipelineStep(built.pipeline, dims, t.global_batch_size, layout.device, built.autocast_dtype,
                            built.distributed_optimizers)
    return ParallelStep(built.parts[0], dims, t.micro_batch_size, t.global_batch_size, layout.device,
                        built.autocast_dtype, built.distributed_optimizers, built.loss_scaler, distiller)


def build_frozen_model(cfg: RunConfig, layout: RunLayout, source: str | None) -> nn.Module:
    """`cfg.model` read from `source` (a HuggingFace directory or Tessera checkpoint; None: initialised
    from `train.seed`, the weights a run without `init_from` starts from) and cut by
    `layout` as the trained model is (built on the meta device, parallelized, each rank reading
    only its shards; under pp an nn.ModuleList of this rank's stages, its layers split over the
    same stages as the trained model's), then frozen: eval mode, no parameter requires a gradient,
    no recomputation or offload (it only runs forward, under no_grad). In one process its matrix
    weights are held in the compute dtype (the ones autocast would cast: compute_weights.py);
    under FSDP the all-gathers cast them to it (`param_dtype`), the fp32 shards staying."""
    cfg = replace(cfg, parallel=replace(cfg.parallel, recompute="none", activation_offload=False))
    compute_dtype = autocast_dtype(cfg.train.dtype)
    cuda = [layout.device] if layout.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # its throw-away init draws no number the run would draw
        model, reference = _whole_model(cfg, layout, source)
    full_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if layout.dims is None:
        parts = [model]
    elif layout.dims.pp == 1:
        parts, _ = _parallelized_parts(model, cfg, layout, compute_dtype, False, None)
    else:
        parts = _frozen_stages(model, cfg, layout.dims, layout.device, compute_dtype)
    if source is not None:
        load_initial_weights(parts, source, cfg.model, full_shapes, layout.device)
    elif reference is not None:  # on ranks, from the seed by name (one process initialised it when built)
        materialize_by_name(parts, reference, cfg.train.seed, layout.device)
    part = parts[0] if layout.dims is None or layout.dims.pp == 1 else nn.ModuleList(parts)
    part.eval()
    part.requires_grad_(False)
    if layout.dims is None and compute_dtype is not None:
        params = dict(part.named_parameters())
        for name in cast_weight_names(part):
            params[name].data = params[name].data.to(compute_dtype)
    return part


def _frozen_stages(model: Transformer, cfg: RunConfig, dims: ParallelDims, device: torch.device,
                   compute_dtype: torch.dtype | None) -> list[nn.Module]:
    """This rank's pipeline stages of a frozen `model` (no schedule: they run beside the trained
    stages, tessera.parallel.pipeline_companion), each parallelized as the trained stages are."""
    def parallelized(m: nn.Module) -> nn.Module:
        return parallelize(m, dims, cfg.parallel, param_dtype=compute_dtype or torch.float32,
                           reduce_dtype=torch.float32, device_type=device.type)

    try:
        _, stages = rank_stage_modules(model, dims, cfg.parallel.vpp, 0.0, parallelized,
                                       schedule=cfg.parallel.pp_schedule)
    except ParallelError as e:
        raise ParallelError(f"train.distill.teacher ({cfg.model.n_layers} layers) cannot be cut by the "
                            f"student's pipeline: {e}") from e
    return stages
