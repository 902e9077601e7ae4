"""The training loop: global batches, gradient accumulation, AdamW, schedule, metrics, checkpoints.

    trainer = Trainer(load_config("configs/tiny-dense.yaml", ["train.steps=20"]), resume=False)
    result = trainer.train()

One optimizer step takes one global batch of `train.global_batch_size` samples from the data
pipeline; the step engine (step_engine.py: one process, pp = 1 layouts, pipelines) splits it into
micro-batches and accumulates gradients of `loss.micro_batch_objective`, so that the step's
gradient is that of the whole global batch (`tessera.train.objectives.loss`). In bf16 mode the fp32 weights
are the master copy: forward and backward run under autocast, the optimizer updates the fp32
parameters; fp16 likewise, with dynamic loss scaling (loss_scaler.py: the engines scale the
backward, the step here unscales, skips a non-finite step and adapts the scale). After the update
the MoE expert bias takes one aux-loss-free balancing step from the step's summed routing counts.
Metrics: metric_record.py; checkpoints: train_checkpoint.py; the run directory: train/run/directory.py.

Modes. What is trained is the run's mode (train/modes/registry.py, chosen by the config; train/modes/mode.py): the
language-model mode (train/modes/lm.py) trains the `model` section's model, the EAGLE mode
(train/modes/eagle.py) a draft head against a frozen target, the DPO mode (train/modes/dpo.py,
train.objective=dpo) the model on preference pairs against its frozen initial weights. A mode hands
the loop its step engine, parts and optimizers, how a step is logged, its start-up and closing lines
and its end-of-run hook (the HuggingFace export of `checkpoint.export_hf`, the EAGLE draft
directory); everything below is the loop's, the same for every mode.

Resilience. A step whose gradient is not finite is skipped on every rank (train.skip_nonfinite; false
stops the run instead); with train.spike_factor a step whose loss spikes is refused and the run
rolls back to its last checkpoint, skipping the batches since (loss_spike.py); both are events in
run_dir/events.jsonl (tessera.parallel.jobs.events). With checkpoint.async a save is a CPU copy
written in the background (tessera.checkpoint.dcp.background), waited for before the next save, a
roll-back, an export and the end of the run. On ranks every metrics line has each rank's step and
wait times and names a straggler (rank_timing.py). A rank started by `--nproc` tells its launcher
which step it trains (tessera.parallel.jobs.progress), so that a restart after a failure is logged
with its step.

Layouts. On ranks (`tessera train --nproc N`, torchrun, or a process group the caller made; a job
of one rank too) the `parallel` section decides the layout (train/run/layout.py) and tessera.train.builder
builds this rank's parts: the model built on the meta device, cut into its shards or pipeline
stages, then only those allocated and initialised by name from the seed, to the values one
process has, or with `train.init_from` read from the source, each rank only its shards
(`init_bytes_read` counts them). Every rank reads the whole global batch and takes its rows, so
the data order does not depend on the layout; statistics are summed over ranks and rank 0 writes
the metrics, the progress bar and the checkpoint bookkeeping. With one process there is no
process group: the step is single_process_step.py, the reference every layout is measured
against. In bf16 every layout computes under autocast as one process does, and where FSDP holds
the weights it also casts them to bf16 for compute (fp32 shards stay the master copy, gradients are
reduced in fp32), except the MoE router's, which FSDP keeps in fp32
(tessera.parallel.data_parallel), as one process does. With `parallel.optimizer=distributed` FSDP is
not used: the weights are replicated in the compute dtype and tessera.parallel.distributed_optimizer
holds sharded fp32 masters and AdamW state instead.

Distillation (an objective term of the language-model mode). With `train.distill.teacher` a
frozen teacher (tessera.train.objectives.teacher), built and cut by the same layout (under pp, stage by stage
beside the student's), runs forward on every micro-batch beside the student, and the objective
mixes its KD term with the data loss (tessera.train.objectives.distill_loss); metrics.jsonl logs both, as
`loss` and `distill_loss`. With `hidden_layers` the projections of hidden-state matching
(tessera.train.objectives.hidden_match) train with their own optimizer (`beside`: stepped, zeroed and scheduled
with the model's, not checkpointed). Evaluation measures the student's data loss only.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from tessera.checkpoint.dcp.background import BackgroundSaver
from tessera.checkpoint.dcp.run_lock import RunDirLock
from tessera.config.errors import ConfigError, TrainingError
from tessera.config.schema import RunConfig
from tessera.models.flops import flops_per_token
from tessera.parallel.comm_stats import CollectiveCounter
from tessera.parallel.compile import resolve_compile
from tessera.parallel.distributed_optimizer import DistributedOptimizer
from tessera.parallel.jobs.events import append_event
from tessera.parallel.jobs.progress import RankProgress
from tessera.train.data_source import TrainingData, build_training_data
from tessera.train.modes.mode import ModeContext, ModeParts
from tessera.train.modes.registry import training_mode
from tessera.train.optimizer import check_distributed_optimizer
from tessera.train.precision import autocast_dtype, check_fp8
from tessera.train.results import StepResult, TrainResult
from tessera.train.run.comm_metrics import comm_record
from tessera.train.run.console import eval_line, step_line, task_line, wants_step_lines
from tessera.train.run.directory import CHECKPOINT_DIR, checkpoint_to_resume, open_metrics
from tessera.train.run.layout import RunLayout, build_layout, resolve_device
from tessera.train.run.loss_spike import MAX_ROLLBACKS, LossSpikeRule, Spike
from tessera.train.run.metric_record import StepFigures, ThroughputWindow
from tessera.train.run.metrics_writer import MetricsWriter
from tessera.train.run.profile_record import mark, recorder_for
from tessera.train.run.rank_timing import RankTiming
from tessera.train.run.rng_state import seed_everything
from tessera.train.run.stop_signal import AgreedStop, StopSignal
from tessera.train.run.task_evaluation import TaskEvaluator, evaluate_tasks
from tessera.train.run.throughput import memory_gib, peak_flops_for_device, step_throughput
from tessera.train.run.train_checkpoint import load_training_state, save_training_state, training_state
from tessera.train.schedule import LRScheduler
from tessera.train.steps.step_engine import StepEngine

__all__ = ["CHECKPOINT_DIR", "TrainResult", "Trainer", "resolve_device"]


def _number(x: float) -> float | str:
    """A float for JSON: inf and NaN as text (JSON has neither)."""
    return x if math.isfinite(x) else str(x)


class Trainer:
    """Builds the data, the run's mode's parts and the schedule from a RunConfig, then trains (any mode,
    any parallel layout)."""

    def __init__(self, cfg: RunConfig, resume: bool = False, progress: RankProgress | None = None,
                 task_evaluator: TaskEvaluator | None = None, rollouts: Any = None,
                 profile: tuple[int, int] | None = None, profile_torch: bool = False,
                 step_hooks: Sequence[Callable[[int], None]] = ()):
        """`progress` is the launcher's view of this rank (tessera train --nproc), or None; `task_evaluator`
        runs `train.eval_tasks` (task_evaluation.py; `tessera train` passes tessera.eval.training.TrainingTasks);
        `rollouts` samples a GRPO run's completions (`tessera train` passes tessera.eval.rollouts.EngineRollouts);
        `profile` the steps (first, last) to record into run_dir/profile (train/run/profile_record.py),
        with torch.profiler's trace too when `profile_torch`; `step_hooks` are called with the step as each
        begins, on the training thread (`tessera train`'s CPU thread count: tessera/cli/adaptive_threads.py)."""
        self.mode = training_mode(cfg)  # train/modes/registry.py: what the run trains
        self.cfg = cfg = self.mode.configure(cfg)  # the config it trains under (EAGLE: the target's model)
        self.progress, self.step_hooks = progress, list(step_hooks)
        self._lines_since: float | None = None  # train(): when per-step text lines are printed, since when
        t = cfg.train
        if t.eval_tasks and task_evaluator is None:
            raise ConfigError(f"train.eval_tasks={t.eval_tasks} needs an evaluator: tessera train makes one; from "
                              "Python pass Trainer(cfg, task_evaluator=tessera.eval.training.TrainingTasks(cfg))")
        self.task_evaluator = task_evaluator
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / CHECKPOINT_DIR
        self.layout: RunLayout = build_layout(cfg)  # refuses a bad layout before any allocation
        self.device = self.layout.device
        self.dp_size = self.layout.dp_size
        self.accumulation = cfg.accumulation_steps(self.dp_size)
        dims = self.layout.dims
        check_fp8(t.fp8, self.device, t.dtype, dims.tp if dims else 1)
        self.run_lock = RunDirLock(self.run_dir)  # held by rank 0 until train() returns (or self is dropped)
        self.resumed_from = checkpoint_to_resume(self.layout, self.run_lock, self.run_dir, resume)
        self.latest_checkpoint = self.resumed_from  # the checkpoint of the current step, once one exists
        self.autocast_dtype = autocast_dtype(t.dtype)
        # each block compiled (tessera.parallel.compile); not under tp, the distributed optimizer or recompute=op
        distributed_optimizer = dims is not None and cfg.parallel.optimizer == "distributed"
        self.compile = resolve_compile(t.compile, self.device, dims.tp if dims else 1, distributed_optimizer,
                                       cfg.parallel.recompute)
        check_distributed_optimizer(cfg, dims)

        seed_everything(t.seed)
        self.data: TrainingData = self._build_data()
        init_from = t.init_from if self.resumed_from is None else None
        self._take(self.mode.build(ModeContext(cfg, self.layout, self.data, init_from, self.compile, rollouts)))
        self.scheduler = LRScheduler([*self.optimizers, *self.beside], cfg.optim, t.steps)
        self._build_resilience()
        self.step = 0
        self.tokens_seen = 0
        if self.resumed_from is not None:
            self._load(self.resumed_from)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak_flops = peak_flops_for_device(self.device, cfg.log.peak_flops)
        self.recorder = recorder_for(profile, cfg, self.layout, self.flops_per_token, self.peak_flops, self.engine,
                                     compiled=self.compile, torch_trace=profile_torch)

    def _take(self, built: ModeParts) -> None:
        """The mode's finished parts: its step engine, what it optimises and checkpoints."""
        self.built = built
        self.engine: StepEngine = built.engine
        self.parts, self.optimizers, self.loss_scaler = built.engine.parts, built.optimizers, built.loss_scaler
        # the optimizers that reduce gradients themselves (parallel.optimizer=distributed)
        self.distributed_optimizers = [o for o in self.optimizers if isinstance(o, DistributedOptimizer)]
        self.full_shapes, self.fp8_layers = built.full_shapes, built.fp8_layers
        self.init_from, self.init_bytes_read = built.init_from, built.init_bytes_read  # bytes this rank read
        self.model = self.parts[0]  # the whole model in one process; this rank's first stage under pp
        self.optimizer = self.optimizers[0]
        # optimizers of what trains beside the model and is not checkpointed (distillation's projections)
        self.beside = built.beside

    def _build_resilience(self) -> None:
        """The background saver (on ranks its process group is made here, by every rank alike), the
        loss-spike rule and, on several ranks, the per-rank timing."""
        cfg, t = self.cfg, self.cfg.train
        self.background = BackgroundSaver(dist.is_initialized()) if cfg.checkpoint.async_save else None
        self.spike_rule = LossSpikeRule(t.spike_factor, t.spike_window) if t.spike_factor is not None else None
        self.timing = (RankTiming(self.layout.rank, self.layout.world_size, cfg.log.straggler_threshold)
                       if self.layout.distributed else None)
        self._rollbacks: dict[int, int] = {}  # checkpoint step -> roll-backs to it
        self._straggler: int | None = None  # the rank named at the last metrics line

    def _build_data(self) -> TrainingData:
        """Every rank builds the same batches; rank 0 first, so that it alone prepares a missing
        corpus (the mode checks that the tokenizer fits its model)."""
        data = self.layout.on_coordinator(lambda: build_training_data(self.cfg))
        return data if data is not None else build_training_data(self.cfg)

    # ---- checkpoints -----------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        """The layout-independent part (the same on every rank); RNG states are stored per rank."""
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                 "data": self.data.train.state_dict()}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        if self.spike_rule is not None:
            state["spike_rule"] = self.spike_rule.state_dict()
        return state

    def save(self) -> Path:
        """Checkpoint model, optimizer, schedule, step, RNG states and data position (train_checkpoint.py).
        With checkpoint.async the state is copied and written in the background: the directory it will
        have is returned at once, and `finish_save` waits for it."""
        rank, world = self.layout.rank, self.layout.world_size
        if self.background is None:
            with self.layout.phase("checkpoint save"), mark("checkpoint", "save"):
                self.latest_checkpoint = save_training_state(self.ckpt_root, self.step, self.parts, self.optimizers,
                                                             self._trainer_state(), self.cfg, rank, world)
            return self.latest_checkpoint
        self.finish_save()
        with self.layout.phase("checkpoint save (copy to CPU)"), mark("checkpoint", "copy to CPU"):
            state, meta = training_state(self.parts, self.optimizers, self._trainer_state(), self.cfg, rank, world)
            return self.background.start(self.ckpt_root, self.step, state, meta, self.cfg.checkpoint.keep_last)

    def finish_save(self) -> None:
        """Wait for the background save in flight, if any; it is then the latest checkpoint."""
        if self.background is not None and self.background.in_flight is not None:
            with self.layout.phase("checkpoint save (background)"):
                self.latest_checkpoint = self.background.wait()

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
        if self.spike_rule is not None:
            self.spike_rule.load_state_dict(trainer.get("spike_rule", {}))

    # ---- one step --------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """One optimizer step on the next global batch; returns the step's result. A step the
        loss-spike rule refuses updates nothing and has `result.spike`."""
        self.step += 1
        if self.progress is not None:
            self.progress.began(self.step)
        for hook in self.step_hooks:
            hook(self.step)
        lr = self.scheduler.set_step(self.step)
        with mark("data", "next batch"):
            batch = self.data.train.next_batch()
        if self.timing is not None:
            with self.timing.waiting():
                self.layout.check_in()
        counter = CollectiveCounter() if self.cfg.log.comm_stats else None
        with counter if counter is not None else nullcontext():
            with self.layout.phase("forward/backward"), mark("region", "forward/backward"):
                result = self.engine.forward_backward(batch)
            spike = self.spike_rule.check(self.step, result.loss) if self.spike_rule is not None else None
            grad_norm = self._update_weights(result) if spike is None else math.nan
        for optimizer in [*self.optimizers, *self.beside]:
            optimizer.zero_grad(set_to_none=True)
        if spike is not None:
            result.spike, result.skipped = spike, True
        elif result.counts:
            self.engine.update_expert_bias(result.counts)
        self.tokens_seen += result.tokens
        result.lr, result.grad_norm = lr, grad_norm
        if counter is not None:
            with self.layout.phase("communication statistics"):
                result.comm = comm_record(counter, self.layout)
        return result

    def _update_weights(self, result: StepResult) -> float:
        """The optimizer step on the accumulated gradients: unscaled (fp16), their norm measured and
        clipped, skipped when it is not finite (sets `result.skipped`); returns the norm. The norm
        is the whole model's, the same on every rank, so every rank skips (and backs off) alike."""
        if self.loss_scaler is not None:
            result.loss_scale = self.loss_scaler.scale
            self.loss_scaler.unscale_(self.parts)
        with self.layout.phase("gradient norm"), self.timing.waiting() if self.timing else nullcontext(), \
                mark("optimizer", "gradient norm"):
            grad_norm = self.engine.clip_grad_norm(self.cfg.train.grad_clip)
        result.skipped = not math.isfinite(grad_norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=result.skipped)
        elif result.skipped:
            self._not_finite(grad_norm, result.loss)
        if not result.skipped:  # a non-finite gradient would poison the weights and Adam's moments
            with self.layout.phase("optimizer step"), mark("optimizer", "step"):
                for optimizer in [*self.optimizers, *self.beside]:
                    optimizer.step()
        return grad_norm

    def _not_finite(self, grad_norm: float, loss: float) -> None:
        """A step whose gradient is not finite (every rank sees the same norm): an event, or the end of
        the run with train.skip_nonfinite=false."""
        if not self.cfg.train.skip_nonfinite:
            raise TrainingError(f"step {self.step}: the gradient is not finite (norm {grad_norm}, loss {loss}) and "
                                "train.skip_nonfinite=false, so the run stops; its last checkpoint "
                                f"({self.latest_checkpoint or 'none yet'}) is as it was. train.skip_nonfinite=true "
                                "skips such a step instead")
        self._event("nonfinite_step", {"grad_norm": str(grad_norm), "loss": _number(loss)},
                    f"step {self.step}: the gradient is not finite (norm {grad_norm}); the update is skipped on "
                    "every rank")

    def _event(self, event: str, fields: dict[str, Any], message: str) -> None:
        """An event of this step in run_dir/events.jsonl and on stderr (rank 0 writes it)."""
        if self.layout.is_coordinator:
            append_event(self.run_dir, event, {"step": self.step, **fields}, f"tessera train: {message}",
                         say=lambda line: tqdm.write(line, file=sys.stderr))

    def _timed_step(self, window: ThroughputWindow, stop: AgreedStop) -> StepResult:
        """`train_step`, its tokens and wall time (the device synchronised around it) added to `window`;
        then the ranks agree whether a stop signal came (the step's last synchronisation point)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        result = self.train_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        window.add(result.tokens, time.perf_counter() - start)
        with self.timing.waiting() if self.timing else nullcontext():
            stop.agree()  # several ranks: a signal that reached any rank stops all after this step
        if self.timing is not None:
            self.timing.step_done(time.perf_counter() - start)
        return result

    # ---- what the mode says ----------------------------------------------------------------
    def startup_lines(self) -> list[str]:
        """What the run's mode says before its first step (`tessera train` prints it on rank 0)."""
        return self.built.summary(self.step)

    def closing_lines(self, result: TrainResult) -> tuple[list[str], list[str]]:
        """What the run's mode says after `result`: (stdout lines, stderr lines)."""
        return self.built.closing(result)

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
        out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
        if self.task_evaluator is not None:  # train.eval_tasks
            out.update(evaluate_tasks(self.task_evaluator, self.parts, self.layout, self.cfg.model, self.step))
        return out

    # ---- the loop --------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Train from the current step to `train.steps`; stop early (with a checkpoint) on SIGTERM/SIGINT.

        On several ranks a signal that reaches any rank stops all of them after the same step."""
        if self.layout.is_coordinator:
            self.run_lock.acquire()  # again, after an earlier train() released it
        writer = open_metrics(self.layout, self.cfg, self.step if self.resumed_from is not None else None)
        result = TrainResult(start_step=self.step, last_step=self.step)
        bar = tqdm(total=self.cfg.train.steps, initial=self.step, desc=self.built.label, unit="step",
                   dynamic_ncols=True, disable=not (self.cfg.log.progress_bar and self.layout.is_coordinator))
        self._lines_since = time.perf_counter() if (self.layout.is_coordinator and wants_step_lines(
            self.cfg.log.progress_bar, sys.stderr)) else None  # per-step text lines on stdout, timed from here
        try:
            with StopSignal() as signal:
                stop = AgreedStop(signal, self.layout.max_over_ranks if self.layout.distributed else None)
                saved_at = self._run_steps(stop, writer, bar, result)
                result.stopped_by_signal = stop.received
                if stop.requested and saved_at != self.step and self.step > result.start_step:
                    result.checkpoint = self.save()
                self.finish_save()  # the last checkpoint is complete before the mode's hook reads it
                result.written = self.built.finish(self.step, self.latest_checkpoint)  # end-of-run hook
        finally:
            self._abandon_save()
            if self.recorder is not None:
                self.recorder.close()
            bar.close()
            if writer is not None:
                writer.close()
            self.run_lock.release()
        for optimizer in self.distributed_optimizers:  # their last all-gathers
            optimizer.wait_for_params()
        result.last_step = self.step
        return result

    def _run_steps(self, stop: AgreedStop, writer: MetricsWriter | None, bar: tqdm, result: TrainResult) -> int | None:
        """Steps until `train.steps` or an agreed stop: each logged, evaluated and checkpointed when
        due. Returns the step last saved (None: none)."""
        t, window, saved_at = self.cfg.train, ThroughputWindow(), None
        while self.step < t.steps and not stop.requested:
            # --profile A:B: the step, its metrics line and its checkpoint recorded (profile_record.py)
            with self.recorder.step_block(self.step + 1) if self.recorder is not None else nullcontext():
                step = self._timed_step(window, stop)
                if step.spike is not None and self._roll_back(step.spike, writer, result, bar):
                    continue
                last = self.step == t.steps
                evaluate = self.built.evaluates and t.eval_interval > 0 and (self.step % t.eval_interval == 0 or last)
                if self.step % t.log_interval == 0 or self.step == result.start_step + 1 or last \
                        or evaluate or stop.requested:
                    self._log(step, window, evaluate, writer, result)
                    bar.set_postfix(loss=f"{step.loss:.4f}", lr=f"{step.lr:.2e}", refresh=False)
                bar.update(1)
                interval = self.cfg.checkpoint.interval
                if last or stop.requested or (interval > 0 and self.step % interval == 0):
                    result.checkpoint = self.save()
                    saved_at = self.step
        return saved_at

    def _abandon_save(self) -> None:
        """A run that fails lets a background save in flight end first (its error is not the news)."""
        if self.background is not None and self.background.in_flight is not None:
            try:
                self.background.wait()
            except Exception:  # noqa: BLE001 - the run's own error is being raised
                pass

    def _roll_back(self, spike: Spike, writer: MetricsWriter | None, result: TrainResult, bar: tqdm) -> bool:
        """After a loss spike: back to the last checkpoint, on from the batch after the spike (the batches
        since the checkpoint are skipped), its metrics lines dropped. False: there is no checkpoint yet,
        and the step stays one whose update was skipped."""
        self.finish_save()
        target = self.latest_checkpoint
        what = f"the loss {spike.loss:.4g} is above {spike.factor:g} x the median {spike.median:.4g} of the last steps"
        fields = {"loss": spike.loss, "median": spike.median, "factor": spike.factor}
        if target is None:
            self._event("loss_spike", {**fields, "rolled_back_to": None},
                        f"step {self.step}: {what}; no checkpoint to go back to yet, so its update is skipped")
            return False
        spiked_at, data_position = self.step, self.data.train.state_dict()
        self._load(target)  # every rank: weights, optimizer, schedule, step, RNG and the rule's history
        self._rollbacks[self.step] = self._rollbacks.get(self.step, 0) + 1
        if self._rollbacks[self.step] > MAX_ROLLBACKS:
            raise TrainingError(f"step {spiked_at}: {what}, after {MAX_ROLLBACKS} roll-backs to {target.name}: the "
                                "spikes do not go away with other batches; lower optim.lr, raise train.spike_factor "
                                "or resume from an earlier checkpoint")
        self.data.train.load_state_dict(data_position)  # on from the batch after the spike
        self._event("loss_spike", {**fields, "step": spiked_at, "rolled_back_to": self.step,
                                   "skipped_batches": spiked_at - self.step},
                    f"step {spiked_at}: {what}; back to {target.name}, skipping the {spiked_at - self.step} batches "
                    f"of steps {self.step + 1}..{spiked_at}")
        if writer is not None:
            writer.rewind(self.step)
        result.records[:] = [r for r in result.records if r["step"] <= self.step]
        bar.n = self.step
        bar.refresh()
        return True

    def _name_straggler(self, times: dict[str, Any]) -> None:
        """An event when a rank starts to lag (or another rank takes over), not at every line it goes on."""
        rank = times.get("straggler_rank")
        if rank is not None and rank != self._straggler:
            step_s = times["rank_step_s"][rank]
            self._event("straggler", {"rank": rank, "lag_s": times["straggler_lag_s"], "step_s": step_s},
                        f"step {self.step}: rank {rank} is the slowest: {times['straggler_lag_s']:.3f} s of its "
                        f"{step_s:.3f} s steps are work the median rank does not have (others wait for it)")
        self._straggler = rank

    def _rank_times(self, result: TrainResult) -> dict[str, Any]:
        """On several ranks every rank's step and wait times since the last line (a collective), the
        straggler named; empty in one process."""
        if self.timing is None:
            return {}
        with self.layout.phase("gathering rank times"):
            times = self.timing.gather()
        if self.step == result.start_step + 1:  # a first step's time is mostly each rank's warm-up
            times = {k: v for k, v in times.items() if not k.startswith("straggler")}
        self._name_straggler(times)
        return times

    def _log(self, step: StepResult, window: ThroughputWindow, evaluate: bool, writer: MetricsWriter | None,
             result: TrainResult) -> None:
        """The step's metrics line, the mode's (with the evaluation when due, and on ranks every
        rank's times), written by rank 0; a new window."""
        throughput = step_throughput(window.tokens, window.seconds, self.flops_per_token, self.peak_flops,
                                     self.layout.world_size)
        mem = memory_gib(self.device)
        threads = torch.get_num_threads() if self.device.type == "cpu" else None  # what the step ran on
        figures = StepFigures(throughput, self.tokens_seen, mem, self._rank_times(result), threads)
        rec = self.built.record(self.step, step, figures)
        if evaluate:
            rec.update(self.evaluate())
            if self.layout.is_coordinator:
                tqdm.write(eval_line(self.step, rec["val_loss"], rec["val_ppl"]), file=sys.stderr)
                if self.task_evaluator is not None:
                    tqdm.write(task_line(self.step, rec), file=sys.stderr)
        if writer is not None:
            writer.write(rec)
            result.records.append(rec)
        if self._lines_since is not None:
            print(step_line(rec, self.cfg.train.steps, time.perf_counter() - self._lines_since), flush=True)
        window.reset()
