"""The run configuration's value checks across fields (`validate_run_config`), run by `load_config`
once the `RunConfig` tree is built (its types were checked while building it). Each step refuses, with
`require`, the first value it finds wrong: a ConfigError naming the dotted key, the value and what is
allowed. The sections are typed `Any` here because `schema.py`, which declares them, imports this module.
"""

from __future__ import annotations

import re
from typing import Any

from tessera.config.dtypes import short_dtype_name
from tessera.config.errors import require
from tessera.config.layout_rules import need_data_parallel_only
from tessera.config.limits import MAX_BATCH_SAMPLES, MAX_SEED, MAX_SPIKE_WINDOW, MAX_TIMEOUT_S, MAX_TOKENS_PER_STEP
from tessera.config.training.dpo import PREFERENCE_KIND, validate_objective
from tessera.config.training.eagle import validate_eagle
from tessera.config.training.grpo import PROMPTS_KIND
from tessera.config.training.indexer_loss import validate_indexer_loss
from tessera.config.training.lora import validate_lora
from tessera.config.training.vision_training import validate_vision_language

SCHEDULES = ("constant", "cosine", "linear", "wsd")
DATA_KINDS = ("pretrain", "sft", "vision_sft", PREFERENCE_KIND, PROMPTS_KIND)


def validate_run_config(cfg: Any) -> None:
    """Value checks across fields; types were checked while building. Each step refuses, with
    `require`, the first value it finds wrong (ConfigError naming the key, the value and what is allowed)."""
    _check_batch(cfg)
    _check_train(cfg.train)
    _check_optim(cfg.optim)
    _check_data(cfg)
    validate_objective(cfg)
    _check_checkpoint(cfg.checkpoint)
    _check_spikes(cfg.train)
    _check_distill(cfg)
    validate_eagle(cfg)
    validate_vision_language(cfg)
    validate_lora(cfg)
    validate_indexer_loss(cfg)
    _check_log(cfg.log)


def _check_batch(cfg: Any) -> None:
    """The run directory, steps, seed, and the sample and batch sizes against the model and the limits."""
    t = cfg.train
    require(bool(cfg.run_dir), "run_dir", cfg.run_dir, "must be a non-empty path")
    require(t.steps >= 1, "train.steps", t.steps, "must be >= 1")
    require(0 <= t.seed <= MAX_SEED, "train.seed", t.seed, f"must be in 0..{MAX_SEED}")
    require(t.seq_len >= 1, "train.seq_len", t.seq_len, "must be >= 1")
    require(t.seq_len <= cfg.model.max_seq_len, "train.seq_len", t.seq_len,
            f"must be <= model.max_seq_len={cfg.model.max_seq_len}")
    require(1 <= t.micro_batch_size <= MAX_BATCH_SAMPLES, "train.micro_batch_size", t.micro_batch_size,
            f"must be in 1..{MAX_BATCH_SAMPLES:,} samples")
    require(1 <= t.global_batch_size <= MAX_BATCH_SAMPLES, "train.global_batch_size", t.global_batch_size,
            f"must be in 1..{MAX_BATCH_SAMPLES:,} samples")
    require(t.global_batch_size % t.micro_batch_size == 0, "train.global_batch_size", t.global_batch_size,
            f"must be a positive multiple of train.micro_batch_size={t.micro_batch_size}")
    require(t.global_batch_size * t.seq_len <= MAX_TOKENS_PER_STEP, "train.global_batch_size", t.global_batch_size,
            f"times train.seq_len={t.seq_len} must be at most {MAX_TOKENS_PER_STEP:,} tokens per step")


def _check_train(t: Any) -> None:
    """Precision and device, the loss chunks, the logging and evaluation cadence, clipping, memory and timeouts."""
    short_dtype_name(t.dtype, "train.dtype")
    require(re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,4})?", t.device) is not None, "train.device",
            t.device, "one of auto, cpu, cuda, cuda:N")
    require(not (t.fp8 and t.device == "cpu"), "train.fp8", t.fp8,
            "FP8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or newer); "
            "train.device=cpu has none: set train.fp8=false")
    require(t.loss_chunk_tokens is None or t.loss_chunk_tokens >= 0, "train.loss_chunk_tokens", t.loss_chunk_tokens,
            "must be null (4096 on CUDA, off on CPU), 0 (off) or a positive number of tokens")
    require(t.log_interval >= 1, "train.log_interval", t.log_interval, "must be >= 1")
    require(t.eval_interval >= 0, "train.eval_interval", t.eval_interval, "must be >= 0 (0 = never)")
    require(t.eval_steps >= 1, "train.eval_steps", t.eval_steps, "must be >= 1")
    require(not t.eval_tasks or t.eval_interval > 0, "train.eval_tasks", t.eval_tasks,
            "runs at each evaluation: set train.eval_interval > 0")
    require(all(isinstance(n, str) and n.strip() and n != "loss" for n in t.eval_tasks), "train.eval_tasks",
            t.eval_tasks, "must be task names (lm-eval's, or humaneval); the loss is val_loss already")
    require(t.eval_tasks_limit is None or t.eval_tasks_limit >= 1, "train.eval_tasks_limit", t.eval_tasks_limit,
            "must be null (all) or >= 1")
    require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 = no clipping)")
    require(t.memory_budget_gib is None or t.memory_budget_gib > 0, "train.memory_budget_gib", t.memory_budget_gib,
            "must be null (the GPU's memory) or > 0 GiB")
    require(0 < t.collective_timeout_s <= MAX_TIMEOUT_S, "train.collective_timeout_s", t.collective_timeout_s,
            f"must be in (0, {MAX_TIMEOUT_S:.0f}] seconds")


def _check_optim(o: Any) -> None:
    require(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    require(0 <= o.min_lr <= o.lr, "optim.min_lr", o.min_lr, f"must be in [0, optim.lr={o.lr}]")
    require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", list(o.betas),
            "two numbers in [0, 1)")
    require(o.eps > 0, "optim.eps", o.eps, "must be > 0")
    require(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    require(o.schedule in SCHEDULES, "optim.schedule", o.schedule, f"one of {', '.join(SCHEDULES)}")
    require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    require(o.decay_steps is None or o.decay_steps >= 0, "optim.decay_steps", o.decay_steps, "None or >= 0")
    require(o.total_steps is None or o.total_steps >= 1, "optim.total_steps", o.total_steps, "None or >= 1")


def _check_data(cfg: Any) -> None:
    """The data's kind and mixture, and a validation split for the evaluations asked for."""
    d, t = cfg.data, cfg.train
    require(d.kind in DATA_KINDS, "data.kind", d.kind, f"one of {', '.join(DATA_KINDS)}")
    require(0 <= d.valid_fraction < 1, "data.valid_fraction", d.valid_fraction, "must be in [0, 1)")
    for i, entry in enumerate(d.datasets):
        require(entry.weight > 0, f"data.datasets[{i}].weight", entry.weight, "must be > 0")
        require(bool(entry.path), f"data.datasets[{i}].path", entry.path, "must be a non-empty path")
    require(d.kind == "pretrain" or bool(d.datasets), "data.kind", d.kind,
            f"{d.kind} needs data.datasets (the bundled corpus is plain text for pretraining)")
    require(t.eval_interval == 0 or d.valid_fraction > 0, "train.eval_interval", t.eval_interval,
            "must be 0 when data.valid_fraction is 0 (there is no validation split to evaluate)")


def _check_checkpoint(c: Any) -> None:
    require(c.interval >= 0, "checkpoint.interval", c.interval, "must be >= 0 (0 = only at the end)")
    require(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "must be >= 1")
    require(c.export_hf_dir is None or bool(c.export_hf_dir), "checkpoint.export_hf_dir", c.export_hf_dir,
            "null (run_dir/hf) or a non-empty path")


def _check_spikes(t: Any) -> None:
    require(t.spike_factor is None or t.spike_factor > 1, "train.spike_factor", t.spike_factor,
            "must be null (off) or > 1 (a loss above spike_factor x the running median is a spike)")
    require(1 <= t.spike_window <= MAX_SPIKE_WINDOW, "train.spike_window", t.spike_window,
            f"must be in 1..{MAX_SPIKE_WINDOW} steps")


def _check_log(log: Any) -> None:
    require(log.straggler_threshold > 0, "log.straggler_threshold", log.straggler_threshold,
            "must be > 0 (a fraction of the step time)")
    require(log.peak_flops is None or log.peak_flops > 0, "log.peak_flops", log.peak_flops,
            "None or > 0 (FLOP/s of one device)")


def _check_distill(cfg: Any) -> None:
    """train.distill: its values, and the layouts and settings it runs under (the teacher itself is
    checked against the student when the trainer loads it: tessera.train.objectives.teacher)."""
    k = cfg.train.distill
    require(k.teacher is None or bool(k.teacher), "train.distill.teacher", k.teacher,
            "a HuggingFace model directory or a Tessera checkpoint / run directory (null = no distillation)")
    require(0 < k.temperature <= 1e4, "train.distill.temperature", k.temperature, "must be in (0, 10000]")
    require(0 <= k.weight <= 1, "train.distill.weight", k.weight, "must be in [0, 1]")
    require(k.teacher is not None or not k.hidden_layers, "train.distill.hidden_layers",
            [list(pair) for pair in k.hidden_layers], "empty without train.distill.teacher")
    if k.teacher is None:
        return
    require(not cfg.train.loss_chunk_tokens, "train.loss_chunk_tokens", cfg.train.loss_chunk_tokens,
            "0 or null with train.distill.teacher (distillation needs the student's logits)")
    require(cfg.model.mtp_depth == 0, "model.mtp_depth", cfg.model.mtp_depth,
            "0 with train.distill.teacher (the distillation objective has no multi-token-prediction term)")
    _check_hidden_matching(cfg)


def _check_hidden_matching(cfg: Any) -> None:
    """train.distill.hidden_layers: student layers that exist (the teacher's are checked when it is
    read: tessera.train.objectives.teacher), and only the layouts hidden_match.py supports."""
    k, p = cfg.train.distill, cfg.parallel
    require(k.hidden_weight >= 0, "train.distill.hidden_weight", k.hidden_weight, "must be >= 0")
    if not k.hidden_layers:
        return
    n = cfg.model.n_layers
    require(all(0 <= i < n and j >= 0 for i, j in k.hidden_layers), "train.distill.hidden_layers",
            [list(pair) for pair in k.hidden_layers],
            f"pairs [student layer, teacher layer] with the student layer in 0..{n - 1} (model.n_layers={n}) "
            "and the teacher layer >= 0")
    need_data_parallel_only(p, "train.distill.hidden_layers", "hidden-state matching")
    require(cfg.train.dtype != "fp16", "train.dtype", cfg.train.dtype,
            "fp32 or bf16 with train.distill.hidden_layers (its projections are not unscaled by fp16 loss scaling)")
