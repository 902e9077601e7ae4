"""The language-model mode (train/modes/registry.py): train the `model` section's model on the data's next tokens.

The objective is the data's cross-entropy (tessera.train.objectives.loss) with its terms: the MoE auxiliary
losses, multi-token prediction (model.mtp_depth) and distillation (train.distill.teacher: the KD
term and, with hidden_layers, hidden-state matching, tessera.train.objectives.teacher). The parts come from
tessera.train.builder (this rank's model, cut by the layout, its optimizers and the fp16 loss
scaler) and the step engine of the layout drives them. A logged step is metric_record.py's line;
the start-up and closing lines are console.py's; at the end of a run that reached train.steps,
`checkpoint.export_hf` writes the last checkpoint as a HuggingFace directory (with train.lora: its
adapters as a PEFT directory, tessera.checkpoint.hf.peft).
"""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path

from tessera.config.errors import ConfigError
from tessera.config.schema import RunConfig
from tessera.train.builder import build_step_engine, build_training_parts
from tessera.train.modes.mode import ModeContext, ModeParts
from tessera.train.objectives.teacher import build_distiller
from tessera.train.results import TrainResult
from tessera.train.run.console import next_steps, schedule_warning, startup_summary
from tessera.train.run.layout import RunLayout
from tessera.train.run.metric_record import step_record


def build_lm_mode(ctx: ModeContext) -> ModeParts:
    """This rank's model parts, optimizers and step engine (with the distillation teacher when the
    config has one), after checking that the tokenizer fits the model's vocabulary."""
    cfg, layout = ctx.cfg, ctx.layout
    if ctx.data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is invalid: the tokenizer has "
                          f"{ctx.data.vocab_size} tokens, so it must be >= {ctx.data.vocab_size}")
    built = build_training_parts(cfg, layout, ctx.init_from, ctx.compile)
    distiller = build_distiller(cfg, layout, built.parts[0])  # train.distill.teacher, frozen; or None
    return ModeParts(
        engine=build_step_engine(cfg, layout, built, distiller), optimizers=built.optimizers,
        full_shapes=built.full_shapes,  # the auxiliary losses' keys: MoE balancing, the indexer's KL
        record=partial(step_record, moe=cfg.model.is_moe or cfg.train.indexer_loss.enabled),
        summary=partial(lm_summary, cfg, layout), closing=partial(lm_closing, cfg),
        finish=partial(export_hf, cfg, layout), loss_scaler=built.loss_scaler,
        # what trains beside the model and is not checkpointed (distillation's projections)
        beside=distiller.optimizers if distiller is not None else [],
        init_from=ctx.init_from, init_bytes_read=built.init_bytes_read, fp8_layers=built.fp8_layers)


def lm_summary(cfg: RunConfig, layout: RunLayout, start_step: int) -> list[str]:
    """What is trained, on what layout and data, where it goes; the schedule's warning."""
    lines = startup_summary(cfg, layout.world_size, str(layout.device), cfg.accumulation_steps(layout.dp_size),
                            start_step, layout.backend)
    warning = schedule_warning(cfg)
    return lines + ([warning] if warning else [])


def lm_closing(cfg: RunConfig, result: TrainResult) -> tuple[list[str], list[str]]:
    """The steps trained and the last loss, the checkpoint and what to run next; the stop signal."""
    last = result.records[-1] if result.records else {}
    summary = f"trained steps {result.start_step + 1}..{result.last_step}"
    if "loss" in last:
        summary += f", last loss {last['loss']:.4f}"
    out = [summary, "\n".join(next_steps(cfg, result.checkpoint, result.written))]
    if result.stopped_by_signal is None:
        return out, []
    return out, [f"stopped by {signal.Signals(result.stopped_by_signal).name}"]


def export_hf(cfg: RunConfig, layout: RunLayout, step: int, checkpoint: Path | None) -> Path | None:
    """checkpoint.export_hf: rank 0 writes `checkpoint` as a HuggingFace directory, one shard file at a
    time (tessera.checkpoint.hf.export); the other ranks wait, and fail with it if it fails. A run
    that reached train.steps is complete, also when a stop signal came during its last step; a run
    the signal ended early is not exported. The checkpoint is the one of this step: the one just
    saved or, when the call started at train.steps (resumed there), the one resumed from."""
    if not (cfg.checkpoint.export_hf and step >= cfg.train.steps):
        return None
    from tessera.checkpoint.hf.export import export_checkpoint_to_hf
    from tessera.checkpoint.hf.peft import write_peft_adapter

    out = Path(cfg.run_dir) / (cfg.checkpoint.export_hf_dir or "hf")  # an absolute path replaces run_dir
    tokenizer = cfg.data.tokenizer or "default"
    if cfg.train.lora.enabled:  # the adapters, as a PEFT directory over the base
        layout.on_coordinator(lambda: write_peft_adapter(checkpoint, out))
    else:
        layout.on_coordinator(lambda: export_checkpoint_to_hf(checkpoint, out, tokenizer=tokenizer))
    return out
