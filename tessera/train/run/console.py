"""What a training run tells the person who started it, on the console (rank 0 only).

- at start: what is trained (parameters, active per token), on what layout and data, the batch and
  schedule, and where metrics, TensorBoard events and checkpoints go (`startup_summary`); a
  warning when `train.steps` outruns the learning-rate schedule (`schedule_warning`);
- at each logged step, when no progress bar shows it (the bar is off, or the console is not a
  terminal: a log file, a batch job), one text line on stdout, as Megatron-LM prints them
  (`step_line`, `wants_step_lines`);
- at each evaluation: the validation loss and perplexity (`eval_line`);
- at the end: the checkpoint written and the commands that resume, sample, serve and export it
  (`next_steps`).

Pure functions of the configuration and figures: the trainer and the CLI print what they return.
"""

from __future__ import annotations

from pathlib import Path

from tessera.config.schema import RunConfig
from tessera.models.counting import count_params


def _millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _layout(cfg: RunConfig, world_size: int, device: str, backend: str | None) -> str:
    group = f", {backend} process group" if backend else ""
    if world_size <= 1:
        return f"1 rank on {device}{group}" if backend else f"1 process on {device}"
    p = cfg.parallel
    sizes = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.resolved_dp_shard(world_size), "cp": p.cp,
             "tp": p.tp, "ep": p.ep}
    parts = [f"{k}={v}" for k, v in sizes.items() if v > 1] or ["replicated"]
    extra = []
    if p.sp:
        extra.append("sp")
    if p.pp > 1:
        extra.append(f"schedule {p.pp_schedule}" + (f" (vpp {p.vpp})" if p.vpp > 1 else ""))
    if sizes["dp_shard"] > 1 or p.cp > 1:
        extra.append(f"zero_stage {p.zero_stage}")
    if p.recompute != "none":
        extra.append(f"recompute {p.recompute}")
    tail = f", {', '.join(extra)}" if extra else ""
    return f"{' x '.join(parts)}{tail}: {world_size} ranks on {device}{group}"


def _data(cfg: RunConfig) -> str:
    d = cfg.data
    if d.datasets:
        sources = ", ".join(f"{e.path} (weight {e.weight:g})" if len(d.datasets) > 1 else e.path
                            for e in d.datasets)
    else:
        sources = "the bundled corpus (Python standard library source)"
    tokenizer = d.tokenizer or "the bundled tokenizer"
    if d.kind == "preference":  # tessera.data.preference: every pair trains
        return f"{d.kind} pairs from {sources}; tokenizer {tokenizer}; none held out"
    if d.kind == "prompts":  # tessera.data.prompts: every prompt trains (GRPO)
        return f"prompts from {sources}; tokenizer {tokenizer}; none held out"
    return (f"{d.kind} on {sources}; tokenizer {tokenizer}; {d.valid_fraction:.0%} of documents held out "
            "for validation")


def startup_summary(cfg: RunConfig, world_size: int, device: str, accumulation: int, start_step: int,
                    backend: str | None = None) -> list[str]:
    """The lines printed before the first step; `backend` is the process group's (None: one process)."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    total, active = count_params(m), count_params(m, active=True)
    model = f"model: {m.family}, {_millions(total)} parameters"
    if m.is_moe:
        model += f", {_millions(active)} active per token ({m.moe.num_experts} experts, top-{m.moe.top_k})"
    model += f"; {m.n_layers} layers, dim {m.dim}, vocabulary {m.vocab_size}"
    horizon = o.total_steps or t.steps
    steps = f"steps {start_step + 1}..{t.steps}" if start_step else f"{t.steps} steps"
    precision = f"{t.dtype} + FP8 linear layers" if t.fp8 else t.dtype
    unit = {"preference": "pairs of sequences", "prompts": f"prompts x {t.grpo.group_size} completions"}.get(
        cfg.data.kind, "sequences")
    batch = (f"batch: {t.global_batch_size} {unit} x {t.seq_len} tokens per step (micro-batch {t.micro_batch_size}"
             f", {accumulation} accumulated per rank), {steps}, {precision}; lr {o.lr:g} {o.schedule} to {o.min_lr:g} "
             f"over {horizon} steps, warm-up {o.warmup_steps}")
    run = Path(cfg.run_dir)
    ckpt = cfg.checkpoint
    every = f"every {ckpt.interval} steps and at the end" if ckpt.interval > 0 else "at the end"
    where = [f"run directory: {run}",
             f"  metrics {run / 'metrics.jsonl'}" + (f", TensorBoard {run / 'tensorboard'}" if cfg.log.tensorboard
                                                     else ""),
             f"  checkpoints {run / 'checkpoints'} ({every}, last {ckpt.keep_last} kept)"]
    evaluation = (f"validation: {t.eval_steps} batches every {t.eval_interval} steps" if t.eval_interval > 0
                  else "validation: off (train.eval_interval=0)")
    layout = f"layout: {_layout(cfg, world_size, device, backend)}"
    k = t.distill
    distill = ([f"distillation: teacher {k.teacher}, temperature {k.temperature:g}, weight {k.weight:g} (objective "
                f"{1 - k.weight:g} x loss + {k.weight:g} x distill_loss)"] if k.teacher is not None else [])
    return [model, layout, f"data: {_data(cfg)}", batch, *distill, *_adapters(cfg), evaluation, *where]


def _adapters(cfg: RunConfig) -> list[str]:
    """train.lora's line: what the adapters are and what stays frozen (none without adapters)."""
    lora = cfg.train.lora
    if not lora.enabled:
        return []
    alpha = lora.alpha if lora.alpha is not None else lora.rank
    saved = f", {', '.join(lora.modules_to_save)} trained whole" if lora.modules_to_save else ""
    base = f"frozen, held {lora.quantize_base}" if lora.quantize_base else "frozen"
    return [f"adapters: LoRA rank {lora.rank}, alpha {alpha:g} ({'rs' if lora.rslora else ''}scale "
            f"{lora.scaling:g}) on {', '.join(lora.target_modules)}{saved}; the base {base}"]


def schedule_warning(cfg: RunConfig) -> str | None:
    """A warning when the run trains past the end of its learning-rate schedule."""
    t, o = cfg.train, cfg.optim
    if o.total_steps is None or t.steps <= o.total_steps or o.schedule == "constant":
        return None
    return (f"warning: train.steps={t.steps} is beyond optim.total_steps={o.total_steps}: steps "
            f"{o.total_steps + 1}..{t.steps} train at optim.min_lr={o.min_lr:g}; leave optim.total_steps unset "
            "to let the schedule follow train.steps, or set it to the length you want")


def wants_step_lines(progress_bar: bool, console) -> bool:
    """Whether each logged step gets a text line: the progress bar is off, or `console` (where the
    bar would draw) is not a terminal."""
    isatty = getattr(console, "isatty", None)
    return not progress_bar or not (isatty is not None and isatty())


def step_line(record: dict, total_steps: int, elapsed_s: float) -> str:
    """`step 10/200 | loss 4.1234 | lr 1.00e-03 | grad norm 0.8123 | tokens/s 1,234 | elapsed 0:00:12`:
    a metrics record's figures (those it has) in one line."""
    parts = [f"step {record['step']}/{total_steps}"]
    for key, label, fmt in (("loss", "loss", ".4f"), ("lr", "lr", ".2e"), ("grad_norm", "grad norm", ".4f"),
                            ("tokens_per_s", "tokens/s", ",.0f")):
        value = record.get(key)
        if isinstance(value, int | float):
            parts.append(f"{label} {value:{fmt}}")
    if record.get("skipped_step"):
        parts.append("skipped (gradient not finite)")
    seconds = int(elapsed_s)
    parts.append(f"elapsed {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}")
    return " | ".join(parts)


def eval_line(step: int, val_loss: float, val_ppl: float) -> str:
    return f"step {step}: validation loss {val_loss:.4f} (perplexity {val_ppl:.2f})"


def task_line(step: int, record: dict) -> str:
    """The train.eval_tasks metrics of an evaluation record ("<task>/<metric>" keys)."""
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if "/" in k and isinstance(v, float))
    return f"step {step}: {metrics or 'no task metrics'}"


def next_steps(cfg: RunConfig, checkpoint: Path | None, written: Path | None = None) -> list[str]:
    """The final lines: the checkpoint, where the run's export went (`written`: checkpoint.export_hf's
    directory), and the commands that continue from it. The run directory's config.yaml is the whole
    configuration, overrides included, so resuming needs nothing else."""
    if checkpoint is None:
        return []
    run = Path(cfg.run_dir)
    resume = [f"checkpoint: {checkpoint}"] + ([f"exported: {written}"] if written is not None else []) + [
        f"  resume:   tessera train {run / 'config.yaml'} --resume   (with --set train.steps=N to go past "
        f"{cfg.train.steps})"]
    if cfg.train.lora.enabled:  # the checkpoint holds the base and the adapters: export them to use them
        base = cfg.train.init_from or "BASE"
        return resume + [f"  adapter:  tessera convert {run} {run}-adapter --lora-adapter   (a PEFT directory)",
                         f"  serve:    tessera serve {base} --lora {run.name}={run}-adapter",
                         f"  merged:   tessera convert {run} {run}-merged --merge-lora   (a HuggingFace directory)"]
    if cfg.data.kind == "vision_sft":  # an image-text model: its requests carry images (docs/serving.md)
        family = cfg.train.vision_language.family
        return resume + [
            f"  serve:    tessera serve {written or run}   (its chat messages may carry images: image_url parts)",
            f"  export:   tessera convert {run} {run}-hf   (a {family} HuggingFace directory with its "
            "tokenizer and image processor)"]
    return resume + [
            f"  generate: tessera generate {run} --prompt 'def main(' --temperature 0.8",
            f"  serve:    tessera serve {run}",
            f"  export:   tessera convert {run} {run}-hf   (a HuggingFace directory with its tokenizer)"]
