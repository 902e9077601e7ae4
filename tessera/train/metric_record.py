"""One line of `run_dir/metrics.jsonl` (and TensorBoard): what the trainer logs about a step.

Written every `train.log_interval` steps and at the first, last, evaluation and stopping steps:
  step; loss (cross-entropy per loss token of the global batch, aux losses and the KD term
  excluded); distill_loss with train.distill.teacher (T^2 x KL(teacher || student) per loss
  token: tessera.train.distill_loss; the objective is (1 - w) loss + w distill_loss);
  distill_hidden_loss with train.distill.hidden_layers (the hidden-state matching per loss token:
  tessera.train.hidden_match); with model.mtp_depth D > 0 mtp_loss and mtp_loss/{k} (depth k's
  token-loss sum per loss token of the main loss, and their mean over depths: the objective adds
  model.mtp_loss_weight x mtp_loss); lr;
  grad_norm (global, before clipping); tokens_per_s, tflops (model TFLOP/s per device) and mfu
  (None without a known peak), averaged since the previous line; loss_tokens (of this step's
  global batch: fewer than its tokens under an SFT mask); tokens_seen; mem_gib (peak);
  skipped_step when the gradient was not finite; loss_scale in fp16 (the scale the step's
  backward used); for MoE models aux_loss, aux/layer{i}/{name} and
  expert_load/layer{i}/{max_over_mean, max_tokens, mean_tokens} (routing slots per expert, summed
  over the step's micro-batches); with log.comm_stats, comm/<kind>_calls and comm/<kind>_bytes
  (tessera.parallel.comm_stats, summed over ranks) and comm/max_rank_bytes. Evaluation steps add
  val_loss and val_ppl (Trainer.evaluate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def step_record(step: int, stats: dict[str, Any], throughput: dict[str, Any], tokens_seen: int, mem_gib: float,
                moe: bool) -> dict[str, Any]:
    """The metrics line of `step` from the step's `stats` (Trainer.train_step) and the window's
    `throughput` (tessera.train.throughput.step_throughput)."""
    rec: dict[str, Any] = {"step": step, "loss": stats["loss"], "lr": stats["lr"], "grad_norm": stats["grad_norm"]}
    rec.update(throughput)
    rec.update(loss_tokens=stats["loss_tokens"], tokens_seen=tokens_seen, mem_gib=mem_gib)
    if stats["skipped"]:
        rec["skipped_step"] = True
    for key in ("distill_loss", "distill_hidden_loss"):
        if key in stats:
            rec[key] = stats[key]
    if "mtp_loss" in stats:
        rec["mtp_loss"] = stats["mtp_loss"]
        rec.update({f"mtp_loss/{k}": v for k, v in stats["mtp_losses"].items()})
    if "loss_scale" in stats:
        rec["loss_scale"] = stats["loss_scale"]
    if moe:
        rec["aux_loss"] = stats["aux_loss"]
        rec.update({f"aux/{k}": v for k, v in sorted(stats["aux_parts"].items())})
        for layer, c in sorted(stats["counts"].items()):
            c = c.float()
            rec[f"expert_load/layer{layer}/max_over_mean"] = float(c.max() / c.mean().clamp_min(1e-9))
            rec[f"expert_load/layer{layer}/max_tokens"] = float(c.max())
            rec[f"expert_load/layer{layer}/mean_tokens"] = float(c.mean())
    rec.update(stats.get("comm", {}))
    return rec
