"""The training loop: global batches, gradient accumulation, AdamW, schedule, metrics, checkpoints.

    trainer = Trainer(load_config("configs/tiny-dense.yaml", ["train.steps=20"]), resume=False)
    result = trainer.train()

One optimizer step takes one global batch of `train.global_batch_size` samples from the data
pipeline, splits it into micro-batches of `train.micro_batch_size`, and accumulates gradients of
`loss.micro_batch_objective` so that the step's gradient is that of the whole global batch
(`tessera.train.loss`). In bf16 mode the fp32 weights are the master copy: forward and backward
run under autocast, the optimizer updates the fp32 parameters; fp16 likewise, with dynamic loss
scaling (loss_scaler.py). After the update the MoE expert bias takes one aux-loss-free balancing
step from the step's summed routing counts.

Every `train.log_interval` steps (and at the first, last, evaluation and stopping steps) one JSON
object goes to `run_dir/metrics.jsonl` and TensorBoard:
  step; loss (cross-entropy per loss token of the global batch, aux losses excluded); lr;
  grad_norm (global, before clipping); tokens_per_s, tflops (model TFLOP/s per device) and mfu
  (None without a known peak), averaged since the previous line; loss_tokens (of this step's
  global batch: fewer than its tokens under an SFT mask); tokens_seen; mem_gib (peak);
  val_loss and val_ppl on evaluation steps; loss_scale in fp16 (the scale the step's backward
  used); for MoE models aux_loss, aux/layer{i}/{name} and expert_load/layer{i}/{max_over_mean,
  max_tokens, mean_tokens} (routing slots per expert, summed over the step's micro-batches); with
  log.comm_stats, comm/<kind>_calls and comm/<kind>_bytes (tessera.parallel.comm_stats, summed over
  ranks) and comm/max_rank_bytes.

Layouts. On ranks (`tessera train --nproc N`, torchrun, or a process group the caller made; a job
of one rank too) the `parallel` section decides the layout (run_layout.py): every rank builds the
model on the meta device, cuts it into its shards (`tessera.parallel.parallelize`) or pipeline stages
(pipeline_step.py), then allocates only those and initialises them by name from the seed
(`tessera.parallel.meta_init`), to the values one process has; with `train.init_from` each rank
reads only its shards from the HuggingFace directory or Tessera checkpoint
(`tessera.checkpoint.sharded_load`; `init_bytes_read` counts them); every rank reads the whole
global batch and takes its rows, so the data order does not depend on the layout; statistics are
summed over ranks and rank 0 writes the metrics, the progress bar and the checkpoint bookkeeping.
With one process nothing of this runs: the step is single_process_step.py, bit for bit what it
always was. In bf16 every layout computes under autocast as one process does, and where FSDP holds
the weights it also casts them to bf16 for compute (fp32 shards stay the master copy, gradients are
reduced in fp32), except the MoE router's, which FSDP keeps in fp32
(tessera.parallel.data_parallel), as one process does. With `parallel.optimizer=distributed` FSDP is
not used: the weights are replicated in the compute dtype and tessera.parallel.distributed_optimizer
holds sharded fp32 masters and AdamW state instead.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tessera.checkpoint import dcp as ckpt
from tessera.checkpoint.run_lock import RunDirLock
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.schema import RunConfig, save_config
from tessera.models.flops import flops_per_token
from tessera.parallel.comm_stats import CollectiveCounter
from tessera.parallel.compile import resolve_compile
from tessera.train.builder import build_step_engine, build_training_parts
from tessera.train.comm_metrics import comm_record
from tessera.train.console import eval_line
from tessera.train.data_source import TrainingData, build_training_data
from tessera.train.metrics_writer import MetricsWriter
from tessera.train.optimizer import check_distributed_optimizer
from tessera.train.precision import autocast_dtype, check_fp8
from tessera.train.rng_state import seed_everything
from tessera.train.run_layout import RunLayout, build_layout, resolve_device
from tessera.train.schedule import LRScheduler
from tessera.train.step_engine import StepEngine
from tessera.train.stop_signal import StopSignal
from tessera.train.throughput import memory_gib, peak_flops_for_device, step_throughput
from tessera.train.train_checkpoint import load_training_state, save_training_state

CHECKPOINT_DIR = "checkpoints"

__all__ = ["CHECKPOINT_DIR", "TrainResult", "Trainer", "resolve_device"]


@dataclass
class TrainResult:
    """What a `train()` call did."""

    start_step: int  # the step the run started from (0, or the resumed checkpoint's)
    last_step: int  # the last completed optimizer step
    stopped_by_signal: int | None = None  # SIGTERM/SIGINT number when stopped early, else None
    checkpoint: Path | None = None  # the last checkpoint written
    records: list[dict[str, Any]] = field(default_factory=list)  # the metric records written (rank 0)
    hf_export: Path | None = None  # the HuggingFace directory written (checkpoint.export_hf)


class Trainer:
    """Builds model, optimizer, schedule and data from a RunConfig, then trains (any parallel layout)."""

    def __init__(self, cfg: RunConfig, resume: bool = False):
        self.cfg = cfg
        t = cfg.train
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / CHECKPOINT_DIR
        self.layout: RunLayout = build_layout(cfg)  # refuses a bad layout before any allocation
        self.device = self.layout.device
        self.dp_size = self.layout.dp_size
        self.accumulation = cfg.accumulation_steps(self.dp_size)
        check_fp8(t.fp8, self.device, t.dtype, self.layout.dims.tp if self.layout.dims else 1)
        self.run_lock = RunDirLock(self.run_dir)  # held by rank 0 until train() returns (or self is dropped)
        resume_from = self._checkpoint_to_resume(resume)
        self.autocast_dtype = autocast_dtype(t.dtype)
        # each block compiled (tessera.parallel.compile); not under tp or the distributed optimizer
        dims = self.layout.dims
        distributed_optimizer = dims is not None and cfg.parallel.optimizer == "distributed"
        self.compile = resolve_compile(t.compile, self.device, dims.tp if dims else 1, distributed_optimizer)
        check_distributed_optimizer(cfg, dims)

        seed_everything(t.seed)
        self.data: TrainingData = self._build_data()
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is invalid: the tokenizer has "
                              f"{self.data.vocab_size} tokens, so it must be >= {self.data.vocab_size}")
        # On ranks the model is built without storage and each rank materialises only its shards
        # (tessera.train.builder).
        self.init_from = t.init_from if resume_from is None else None
        built = build_training_parts(cfg, self.layout, self.init_from, self.compile)
        self.parts, self.optimizers, self.loss_scaler = built.parts, built.optimizers, built.loss_scaler
        self.distributed_optimizers = built.distributed_optimizers
        self.full_shapes, self.fp8_layers = built.full_shapes, built.fp8_layers
        self.init_bytes_read = built.init_bytes_read  # bytes this rank read from train.init_from
        self.model = self.parts[0]  # the whole model in one process; this rank's first stage under pp
        self.optimizer = self.optimizers[0]
        self.engine: StepEngine = build_step_engine(cfg, self.layout, built)
        self.scheduler = LRScheduler(self.optimizers, cfg.optim, t.steps)
        self.step = 0
        self.tokens_seen = 0
        if resume_from is not None:
            self._load(resume_from)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak_flops = peak_flops_for_device(self.device, cfg.log.peak_flops)
        self.resumed_from = resume_from
        self.latest_checkpoint = resume_from  # the checkpoint of the current step, once one exists

    # ---- setup -----------------------------------------------------------------------------
    def _checkpoint_to_resume(self, resume: bool) -> Path | None:
        """Rank 0 looks at the run directory and every rank follows its decision.

        Leftovers of an interrupted save are cleaned up first: a crash while a step was saved again
        leaves that step's complete checkpoint under `.old-step_N-PID` (dcp.remove_partial_saves
        puts it back), and the step to resume from must be chosen after it is back in place. Before
        anything, rank 0 locks the run directory (run_lock.py): a second trainer on it is refused.
        The checkpoint resumed from is the newest whose files match their checksums; each newer
        damaged one is named on stderr, with the file that is wrong."""

        def decide() -> tuple[str | None, str | None]:
            self.run_lock.acquire()
            ckpt.remove_partial_saves(self.ckpt_root)
            found = ckpt.find_latest(self.ckpt_root)
            if resume and found is not None:
                found, damaged = ckpt.find_latest_good(self.ckpt_root)
                if found is None:
                    raise CheckpointError(f"no usable checkpoint in {str(self.ckpt_root)!r} to resume from: "
                                          + "; ".join(damaged))
                for line in damaged:
                    print(f"warning: {line}; resuming from {found.name} instead", file=sys.stderr)
            if not resume and found is not None:
                return (None, f"run_dir={str(self.run_dir)!r} already holds checkpoints; pass --resume to "
                              "continue that run, or choose another run_dir")
            return (str(found) if resume and found is not None else None, None)

        # on_coordinator: the other ranks wait for the cleanup (and fail with rank 0 if it fails).
        found, error = self.layout.broadcast(self.layout.on_coordinator(decide))
        if error is not None:
            raise ConfigError(error)
        return Path(found) if found is not None else None

    def _build_data(self) -> TrainingData:
        """Every rank builds the same batches; rank 0 first, so that it alone prepares a missing corpus."""
        data = self.layout.on_coordinator(lambda: build_training_data(self.cfg))
        return data if data is not None else build_training_data(self.cfg)

    # ---- checkpoints -----------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        """The layout-independent part (the same on every rank); RNG states are stored per rank."""
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                 "data": self.data.train.state_dict()}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def save(self) -> Path:
        """Checkpoint model, optimizer, schedule, step, RNG states and data position (train_checkpoint.py)."""
        with self.layout.phase("checkpoint save"):
            self.latest_checkpoint = save_training_state(
                self.ckpt_root, self.step, self.parts, self.optimizers, self._trainer_state(), self.cfg,
                self.layout.rank, self.layout.world_size)
        return self.latest_checkpoint

    def _load(self, path: Path) -> None:
        with self.layout.phase("checkpoint load"):
            trainer = load_training_state(path, self.parts, self.optimizers, self.full_shapes, self.cfg,
                                          self.layout.rank, self.layout.world_size)
        self.step = int(trainer["step"])
        self.tokens_seen = int(trainer["tokens_seen"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.data.train.load_state_dict(trainer["data"])
        if self.loss_scaler is not None and "loss_scaler" in trainer:
            self.loss_scaler.load_state_dict(trainer["loss_scaler"])

    # ---- one step --------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One optimizer step on the next global batch; returns the step's statistics."""
        self.step += 1
        lr = self.scheduler.set_step(self.step)
        batch = self.data.train.next_batch()
        counter = CollectiveCounter() if self.cfg.log.comm_stats else None
        if counter is not None:
            counter.__enter__()
        try:
            with self.layout.phase("forward/backward"):
                stats = self.engine.forward_backward(batch)
            if self.loss_scaler is not None:
                stats["loss_scale"] = self.loss_scaler.scale
                self.loss_scaler.unscale_(self.parts)
            with self.layout.phase("gradient norm"):
                grad_norm = self.engine.clip_grad_norm(self.cfg.train.grad_clip)
            stats["skipped"] = not math.isfinite(grad_norm)
            if self.loss_scaler is not None:
                self.loss_scaler.update(found_inf=stats["skipped"])
            if not stats["skipped"]:  # a non-finite gradient would poison the weights and Adam's moments
                with self.layout.phase("optimizer step"):
                    for optimizer in self.optimizers:
                        optimizer.step()
        finally:
            if counter is not None:
                counter.__exit__(None, None, None)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if stats["counts"]:
            self.engine.update_expert_bias(stats["counts"])
        self.tokens_seen += stats["tokens"]
        stats.update(lr=lr, grad_norm=grad_norm)
        if counter is not None:
            with self.layout.phase("communication statistics"):
                stats["comm"] = comm_record(counter, self.layout)
        return stats

    def _export_hf(self, checkpoint: Path) -> Path:
        """checkpoint.export_hf: rank 0 writes `checkpoint` as a HuggingFace directory, one shard file
        at a time (tessera.checkpoint.hf_export); the other ranks wait, and fail with it if it fails."""
        from tessera.checkpoint.hf_export import export_checkpoint_to_hf

        out = self.run_dir / (self.cfg.checkpoint.export_hf_dir or "hf")  # an absolute path replaces run_dir
        tokenizer = self.cfg.data.tokenizer or "default"
        self.layout.on_coordinator(lambda: export_checkpoint_to_hf(checkpoint, out, tokenizer=tokenizer))
        return out

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Validation loss (sum of token losses / loss tokens) and perplexity over eval_steps batches."""
        for m in self.parts:
            m.eval()
        with self.layout.phase("evaluation"):
            total, n = self.engine.evaluate(self.data.validation_batches(self.cfg.train.eval_steps))
        for m in self.parts:
            m.train()
        loss = total / max(n, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}

    # ---- the loop --------------------------------------------------------------------------
    def _record(self, stats: dict[str, Any], tokens: int, seconds: float) -> dict[str, Any]:
        rec: dict[str, Any] = {"step": self.step, "loss": stats["loss"], "lr": stats["lr"],
                               "grad_norm": stats["grad_norm"]}
        rec.update(step_throughput(tokens, seconds, self.flops_per_token, self.peak_flops, self.layout.world_size))
        rec.update(loss_tokens=stats["loss_tokens"], tokens_seen=self.tokens_seen, mem_gib=memory_gib(self.device))
        if stats["skipped"]:
            rec["skipped_step"] = True
        if "loss_scale" in stats:
            rec["loss_scale"] = stats["loss_scale"]
        if self.cfg.model.is_moe:
            rec["aux_loss"] = stats["aux_loss"]
            rec.update({f"aux/{k}": v for k, v in sorted(stats["aux_parts"].items())})
            for layer, c in sorted(stats["counts"].items()):
                c = c.float()
                rec[f"expert_load/layer{layer}/max_over_mean"] = float(c.max() / c.mean().clamp_min(1e-9))
                rec[f"expert_load/layer{layer}/max_tokens"] = float(c.max())
                rec[f"expert_load/layer{layer}/mean_tokens"] = float(c.mean())
        rec.update(stats.get("comm", {}))
        return rec

    def _prepare_run_dir(self) -> MetricsWriter | None:
        """Rank 0 opens the metrics (interrupted saves were cleaned up before the resume decision);
        the others wait for it."""

        def prepare() -> MetricsWriter:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / "config.yaml")
            resume_step = self.step if self.resumed_from is not None else None
            return MetricsWriter(self.run_dir, self.cfg.log.tensorboard, resume_step=resume_step)

        return self.layout.on_coordinator(prepare)

    def train(self) -> TrainResult:
        """Train from the current step to `train.steps`; stop early (with a checkpoint) on SIGTERM/SIGINT.

        On several ranks a signal that reaches any rank stops all of them after the same step."""
        t, log = self.cfg.train, self.cfg.log
        if self.layout.is_coordinator:
            self.run_lock.acquire()  # again, after an earlier train() released it
        writer = self._prepare_run_dir()
        result = TrainResult(start_step=self.step, last_step=self.step)
        bar = tqdm(total=t.steps, initial=self.step, disable=not (log.progress_bar and self.layout.is_coordinator),
                   desc="train", unit="step", dynamic_ncols=True)
        window_tokens, window_seconds = 0, 0.0
        saved_at = None
        agreed: int | None = None  # on several ranks: the stop signal every rank has agreed on

        try:
            with StopSignal() as stop:

                def stop_requested() -> bool:  # one process: the flag itself; several: what all agreed on
                    return agreed is not None if self.layout.distributed else stop.requested

                while self.step < t.steps and not stop_requested():
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    start = time.perf_counter()
                    stats = self.train_step()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    window_seconds += time.perf_counter() - start
                    window_tokens += stats["tokens"]
                    if self.layout.distributed:  # a signal that reached any rank stops all after this step
                        agreed = self.layout.max_over_ranks(stop.received or 0) or None
                    last = self.step == t.steps
                    evaluate = t.eval_interval > 0 and (self.step % t.eval_interval == 0 or last)
                    if self.step % t.log_interval == 0 or self.step == result.start_step + 1 or last \
                            or evaluate or stop_requested():
                        rec = self._record(stats, window_tokens, window_seconds)
                        if evaluate:
                            rec.update(self.evaluate())
                            if self.layout.is_coordinator:
                                tqdm.write(eval_line(self.step, rec["val_loss"], rec["val_ppl"]), file=sys.stderr)
                        if writer is not None:
                            writer.write(rec)
                            result.records.append(rec)
                        window_tokens, window_seconds = 0, 0.0
                        bar.set_postfix(loss=f"{stats['loss']:.4f}", lr=f"{stats['lr']:.2e}", refresh=False)
                    bar.update(1)
                    interval = self.cfg.checkpoint.interval
                    if last or stop_requested() or (interval > 0 and self.step % interval == 0):
                        result.checkpoint = self.save()
                        saved_at = self.step
                result.stopped_by_signal = agreed if self.layout.distributed else stop.received
                if stop_requested() and saved_at != self.step and self.step > result.start_step:
                    result.checkpoint = self.save()
                # A run that reached train.steps is complete, also when a stop signal came during its
                # last step; a run the signal ended early is not exported.
                if self.cfg.checkpoint.export_hf and self.step >= t.steps:
                    # The checkpoint of this step: the one just saved or, when the call started at
                    # train.steps (resumed there), the one resumed from; never a second save of it.
                    result.hf_export = self._export_hf(self.latest_checkpoint)
        finally:
            bar.close()
            if writer is not None:
                writer.close()
            self.run_lock.release()
        for optimizer in self.distributed_optimizers:  # their last all-gathers
            optimizer.wait_for_params()
        result.last_step = self.step
        return result
