"""The training loop: global batches, gradient accumulation, AdamW, schedule, metrics, checkpoints.

    trainer = Trainer(load_config("configs/tiny-dense.yaml", ["train.steps=20"]), resume=False)
    result = trainer.train()

One optimizer step takes one global batch of `train.global_batch_size` samples from the data
pipeline, splits it into micro-batches of `train.micro_batch_size`, and accumulates gradients of
`loss.micro_batch_objective` so that the step's gradient is that of the whole global batch
(`tessera.train.loss`). In bf16 mode the fp32 weights are the master copy: forward and backward
run under autocast, the optimizer updates the fp32 parameters. After the update the MoE expert
bias takes one aux-loss-free balancing step from the step's summed routing counts.

Every `train.log_interval` steps (and at the first, last, evaluation and stopping steps) one JSON
object goes to `run_dir/metrics.jsonl` and TensorBoard:
  step; loss (cross-entropy per loss token of the global batch, aux losses excluded); lr;
  grad_norm (global, before clipping); tokens_per_s, tflops (model TFLOP/s per device) and mfu
  (None without a known peak), averaged since the previous line; loss_tokens (of this step's
  global batch: fewer than its tokens under an SFT mask); tokens_seen; mem_gib (peak);
  val_loss and val_ppl on evaluation steps; for MoE models aux_loss, aux/layer{i}/{name} and
  expert_load/layer{i}/{max_over_mean, max_tokens, mean_tokens} (routing slots per expert, summed
  over the step's micro-batches).
"""

from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from tqdm import tqdm

from tessera.checkpoint import dcp as ckpt
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.flops import flops_per_token
from tessera.config.schema import RunConfig, save_config
from tessera.models import Transformer
from tessera.train.data_source import Batch, TrainingData, build_training_data
from tessera.train.loss import count_loss_tokens, micro_batch_objective, token_loss_sum
from tessera.train.metrics_writer import MetricsWriter
from tessera.train.optimizer import build_optimizer
from tessera.train.rng_state import capture_rng_state, restore_rng_state, seed_everything
from tessera.train.schedule import LRScheduler
from tessera.train.stop_signal import StopSignal
from tessera.train.throughput import memory_gib, peak_flops_for_device, step_throughput

CHECKPOINT_DIR = "checkpoints"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} is invalid: CUDA is not available here; use cpu or auto")
    return torch.device(name)


@dataclass
class TrainResult:
    """What a `train()` call did."""

    start_step: int  # the step the run started from (0, or the resumed checkpoint's)
    last_step: int  # the last completed optimizer step
    stopped_by_signal: int | None = None  # SIGTERM/SIGINT number when stopped early, else None
    checkpoint: Path | None = None  # the last checkpoint written
    records: list[dict[str, Any]] = field(default_factory=list)  # the metric records written


class Trainer:
    """Builds model, optimizer, schedule and data from a RunConfig, then trains."""

    def __init__(self, cfg: RunConfig, resume: bool = False):
        self.cfg = cfg
        t = cfg.train
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / CHECKPOINT_DIR
        cfg.parallel.resolved_dp_shard(1)  # this trainer runs one process: refuse a multi-rank layout
        self.dp_size = 1
        self.accumulation = cfg.accumulation_steps(self.dp_size)
        resume_from = self._checkpoint_to_resume(resume)
        self.device = resolve_device(t.device)
        self.autocast_dtype = torch.bfloat16 if t.dtype == "bf16" else None

        seed_everything(t.seed)
        self.data: TrainingData = build_training_data(cfg)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is invalid: the tokenizer has "
                              f"{self.data.vocab_size} tokens, so it must be >= {self.data.vocab_size}")
        self.model = Transformer(cfg.model, init_seed=t.seed).to(self.device)
        self.model.train()
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = LRScheduler(self.optimizer, cfg.optim, t.steps)
        self.step = 0
        self.tokens_seen = 0
        if resume_from is not None:
            self._load(resume_from)
        elif t.init_from:
            self._init_from(t.init_from)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak_flops = peak_flops_for_device(self.device, cfg.log.peak_flops)
        self.resumed_from = resume_from

    # ---- setup -----------------------------------------------------------------------------
    def _checkpoint_to_resume(self, resume: bool) -> Path | None:
        found = ckpt.find_latest(self.ckpt_root)
        if not resume and found is not None:
            raise ConfigError(f"run_dir={str(self.run_dir)!r} already holds checkpoints; pass --resume to "
                              "continue that run, or choose another run_dir")
        return found if resume else None

    def _init_from(self, path: str) -> None:
        """Weights from a HuggingFace directory or a Tessera checkpoint; optimizer and step start fresh."""
        from tessera.checkpoint.convert import is_hf_directory, load_model_weights
        from tessera.hf import load_pretrained

        if not is_hf_directory(path):
            load_model_weights(ckpt.resolve_checkpoint(path), self.model)
            return
        pretrained = load_pretrained(path, dtype=torch.float32)
        ours, theirs = self.model.state_dict(), pretrained.state_dict()
        for key, value in ours.items():
            if key not in theirs:
                raise CheckpointError(f"train.init_from={path!r} does not fit the model: it has no {key!r}")
            if theirs[key].shape != value.shape:
                raise CheckpointError(f"train.init_from={path!r} does not fit the model: {key!r} has shape "
                                      f"{list(theirs[key].shape)} there but {list(value.shape)} in the model")
        self.model.load_state_dict(theirs, strict=True)

    # ---- checkpoints -----------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                "data": self.data.train.state_dict(), "rng": capture_rng_state()}

    def save(self) -> Path:
        """Checkpoint model, optimizer, schedule, step, RNG states and data position.

        Model and optimizer tensors are stored by parameter name with their global shapes
        (`get_state_dict`), so another layout can load them. The trainer state (step, schedule,
        data position, RNG states) is one pickled object: this process's; with several ranks each
        would store its own RNG states under a per-rank key.
        """
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd, "trainer": pickle.dumps(self._trainer_state())}
        meta = {"config": self.cfg.to_dict()}
        return ckpt.save_checkpoint(self.ckpt_root, self.step, state, meta, self.cfg.checkpoint.keep_last)

    def _load(self, path: Path) -> None:
        expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        ckpt.check_compatible(path, "model", expected)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd, "trainer": b""}
        ckpt.load_checkpoint(path, state)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        trainer = pickle.loads(state["trainer"])  # checkpoints are trusted input, like torch.load
        self.step = int(trainer["step"])
        self.tokens_seen = int(trainer["tokens_seen"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.data.train.load_state_dict(trainer["data"])
        restore_rng_state(trainer["rng"])

    # ---- one step --------------------------------------------------------------------------
    def _forward_backward(self, batch: Batch) -> dict[str, Any]:
        """Accumulate the gradient of one global batch; return its loss statistics."""
        inputs, targets, mask = batch.inputs, batch.targets, batch.target_mask
        n_loss_tokens = count_loss_tokens(targets, mask)
        mb = self.cfg.train.micro_batch_size
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_total = torch.zeros((), dtype=torch.float64)
        aux_parts: dict[str, float] = {}
        counts: dict[int, torch.Tensor] = {}
        for i in range(self.accumulation):
            rows = slice(i * mb, (i + 1) * mb)
            x = inputs[rows].to(self.device, non_blocking=True)
            y = targets[rows].to(self.device, non_blocking=True)
            m = mask[rows].to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                                enabled=self.autocast_dtype is not None):
                out = self.model(x)
            micro_sum = token_loss_sum(out.logits, y, m)
            micro_batch_objective(micro_sum, out.aux_loss, n_loss_tokens, self.accumulation).backward()
            loss_sum += micro_sum.detach().double().cpu()
            aux_total += out.aux_loss.detach().double().cpu()
            for name, value in out.aux_losses.items():
                aux_parts[name] = aux_parts.get(name, 0.0) + float(value.detach()) / self.accumulation
            for layer, c in out.expert_counts.items():
                c = c.detach()
                counts[layer] = counts[layer] + c if layer in counts else c.clone()
        return {"loss": float(loss_sum) / max(n_loss_tokens, 1),
                "aux_loss": float(aux_total) / self.accumulation, "aux_parts": aux_parts, "counts": counts,
                "loss_tokens": n_loss_tokens, "tokens": int(inputs.numel())}

    def train_step(self) -> dict[str, Any]:
        """One optimizer step on the next global batch; returns the step's statistics."""
        self.step += 1
        lr = self.scheduler.set_step(self.step)
        batch = self.data.train.next_batch()
        stats = self._forward_backward(batch)
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        stats["skipped"] = not math.isfinite(grad_norm)
        if not stats["skipped"]:  # a non-finite gradient would poison the weights and Adam's moments
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if stats["counts"]:
            self.model.update_expert_bias(stats["counts"])
        self.tokens_seen += stats["tokens"]
        stats.update(lr=lr, grad_norm=grad_norm)
        return stats

    # ---- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss (sum of token losses / loss tokens) and perplexity over eval_steps batches."""
        self.model.eval()
        total, n = 0.0, 0
        mb = self.cfg.train.micro_batch_size
        for batch in self.data.validation_batches(self.cfg.train.eval_steps):
            for i in range(0, batch.tokens.shape[0], mb):
                x = batch.inputs[i:i + mb].to(self.device)
                y = batch.targets[i:i + mb].to(self.device)
                m = batch.target_mask[i:i + mb].to(self.device)
                with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                                    enabled=self.autocast_dtype is not None):
                    logits = self.model(x).logits
                total += float(token_loss_sum(logits, y, m))
                n += count_loss_tokens(y, m)
        self.model.train()
        loss = total / max(n, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}

    # ---- the loop --------------------------------------------------------------------------
    def _record(self, stats: dict[str, Any], tokens: int, seconds: float) -> dict[str, Any]:
        rec: dict[str, Any] = {"step": self.step, "loss": stats["loss"], "lr": stats["lr"],
                               "grad_norm": stats["grad_norm"]}
        rec.update(step_throughput(tokens, seconds, self.flops_per_token, self.peak_flops, self.dp_size))
        rec.update(loss_tokens=stats["loss_tokens"], tokens_seen=self.tokens_seen, mem_gib=memory_gib(self.device))
        if stats["skipped"]:
            rec["skipped_step"] = True
        if self.cfg.model.is_moe:
            rec["aux_loss"] = stats["aux_loss"]
            rec.update({f"aux/{k}": v for k, v in sorted(stats["aux_parts"].items())})
            for layer, c in sorted(stats["counts"].items()):
                c = c.float()
                rec[f"expert_load/layer{layer}/max_over_mean"] = float(c.max() / c.mean().clamp_min(1e-9))
                rec[f"expert_load/layer{layer}/max_tokens"] = float(c.max())
                rec[f"expert_load/layer{layer}/mean_tokens"] = float(c.mean())
        return rec

    def train(self) -> TrainResult:
        """Train from the current step to `train.steps`; stop early (with a checkpoint) on SIGTERM/SIGINT."""
        t, log = self.cfg.train, self.cfg.log
        ckpt.remove_partial_saves(self.ckpt_root)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")
        resume_step = self.step if self.resumed_from is not None else None
        writer = MetricsWriter(self.run_dir, log.tensorboard, resume_step=resume_step)
        result = TrainResult(start_step=self.step, last_step=self.step)
        bar = tqdm(total=t.steps, initial=self.step, disable=not log.progress_bar, desc="train", unit="step",
                   dynamic_ncols=True)
        window_tokens, window_seconds = 0, 0.0
        saved_at = None
        try:
            with StopSignal() as stop:
                while self.step < t.steps and not stop.requested:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    start = time.perf_counter()
                    stats = self.train_step()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    window_seconds += time.perf_counter() - start
                    window_tokens += stats["tokens"]
                    last = self.step == t.steps
                    evaluate = t.eval_interval > 0 and (self.step % t.eval_interval == 0 or last)
                    if self.step % t.log_interval == 0 or self.step == result.start_step + 1 or last \
                            or evaluate or stop.requested:
                        rec = self._record(stats, window_tokens, window_seconds)
                        if evaluate:
                            rec.update(self.evaluate())
                        writer.write(rec)
                        result.records.append(rec)
                        window_tokens, window_seconds = 0, 0.0
                        bar.set_postfix(loss=f"{stats['loss']:.4f}", lr=f"{stats['lr']:.2e}", refresh=False)
                    bar.update(1)
                    interval = self.cfg.checkpoint.interval
                    if last or stop.requested or (interval > 0 and self.step % interval == 0):
                        result.checkpoint = self.save()
                        saved_at = self.step
                result.stopped_by_signal = stop.received
                if stop.requested and saved_at != self.step and self.step > result.start_step:
                    result.checkpoint = self.save()
        finally:
            bar.close()
            writer.close()
        result.last_step = self.step
        return result
