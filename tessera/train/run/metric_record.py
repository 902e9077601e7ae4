"""One line of `run_dir/metrics.jsonl` (and TensorBoard): what the trainer logs about a step.

Written every `train.log_interval` steps and at the first, last, evaluation and stopping steps:
  step; loss (cross-entropy per loss token of the global batch, aux losses and the KD term
  excluded); distill_loss with train.distill.teacher (T^2 x KL(teacher || student) per loss
  token: tessera.train.objectives.distill_loss; the objective is (1 - w) loss + w distill_loss);
  distill_hidden_loss with train.distill.hidden_layers (the hidden-state matching per loss token:
  tessera.train.objectives.hidden_match); with model.mtp_depth D > 0 mtp_loss and mtp_loss/{k} (depth k's
  token-loss sum per loss token of the main loss, and their mean over depths: the objective adds
  model.mtp_loss_weight x mtp_loss); lr;
  grad_norm (global, before clipping); tokens_per_s, tflops (model TFLOP/s per device) and mfu
  (None without a known peak), averaged since the previous line; loss_tokens (of this step's
  global batch: fewer than its tokens under an SFT mask); tokens_seen; mem_gib (peak); cpu_threads on a
  CPU (the intra-op thread count the step ran on: tessera/cli/adaptive_threads.py changes it);
  skipped_step when the gradient was not finite; loss_scale in fp16 (the scale the step's
  backward used); for MoE models aux_loss, aux/layer{i}/{name} and
  expert_load/layer{i}/{max_over_mean, max_tokens, mean_tokens} (routing slots per expert, summed
  over the step's micro-batches); with log.comm_stats, comm/<kind>_calls and comm/<kind>_bytes
  (tessera.parallel.comm_stats, summed over ranks) and comm/max_rank_bytes; on several ranks each
  rank's step and wait times and the straggler (rank_timing.py). Evaluation steps add val_loss and
  val_ppl (Trainer.evaluate). An EAGLE run writes its own line (train/modes/eagle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.train.results import StepResult


@dataclass
class ThroughputWindow:
    """Tokens and seconds of the steps since the last logged line."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def reset(self) -> None:
        self.tokens, self.seconds = 0, 0.0


@dataclass
class StepFigures:
    """What the loop measured over the steps since the last metrics line, beside the step's result."""

    throughput: dict[str, Any]  # tokens_per_s, tflops, mfu (tessera.train.run.throughput.step_throughput)
    tokens_seen: int
    mem_gib: float  # peak
    rank_times: dict[str, Any] = field(default_factory=dict)  # on ranks: each rank's times (rank_timing.py)
    cpu_threads: int | None = None  # a CPU run: the intra-op thread count the step ran on (torch.get_num_threads)


def step_record(step: int, result: StepResult, figures: StepFigures, moe: bool) -> dict[str, Any]:
    """The metrics line of `step` of a model's run from the step's `result` (Trainer.train_step) and
    what the loop measured (`figures`); the mode's own scalars, when it has any, before comm."""
    rec: dict[str, Any] = {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm}
    rec.update(figures.throughput)
    rec.update(loss_tokens=result.loss_tokens, tokens_seen=figures.tokens_seen, mem_gib=figures.mem_gib)
    if figures.cpu_threads is not None:
        rec["cpu_threads"] = figures.cpu_threads
    if result.skipped:
        rec["skipped_step"] = True
    if result.distill_loss is not None:
        rec["distill_loss"] = result.distill_loss
    if result.distill_hidden_loss is not None:
        rec["distill_hidden_loss"] = result.distill_hidden_loss
    if result.mtp_losses:
        rec["mtp_loss"] = result.mtp_loss
        rec.update({f"mtp_loss/{k}": v for k, v in result.mtp_losses.items()})
    if result.loss_scale is not None:
        rec["loss_scale"] = result.loss_scale
    if moe:
        rec["aux_loss"] = result.aux_loss
        rec.update({f"aux/{k}": v for k, v in sorted(result.aux_parts.items())})
        for layer, c in sorted(result.counts.items()):
            c = c.float()
            rec[f"expert_load/layer{layer}/max_over_mean"] = float(c.max() / c.mean().clamp_min(1e-9))
            rec[f"expert_load/layer{layer}/max_tokens"] = float(c.max())
            rec[f"expert_load/layer{layer}/mean_tokens"] = float(c.mean())
    rec.update(result.scalars)
    rec.update(result.comm)
    rec.update(figures.rank_times)
    return rec
