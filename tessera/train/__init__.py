"""Layer 6: the training loop, loss, optimizer, learning-rate schedules and metrics.

One loop (trainer.py) over the parts the builder makes for this rank (builder.py); its wings are
the step engines of each layout (`steps/`), the modes it trains (`modes/`), the objective's terms
(`objectives/`) and the run around it: directory, checkpoints, metrics, console (`run/`)."""

from tessera.train.objectives.loss import count_loss_tokens, micro_batch_objective, token_loss_sum
from tessera.train.optimizer import build_optimizer, weight_decay_groups
from tessera.train.run.throughput import peak_flops_for_device, step_throughput
from tessera.train.schedule import LRScheduler, lr_at
from tessera.train.steps.step_engine import StepEngine
from tessera.train.trainer import Trainer, TrainResult

__all__ = [
    "LRScheduler", "StepEngine", "TrainResult", "Trainer", "build_optimizer", "count_loss_tokens", "lr_at",
    "micro_batch_objective", "peak_flops_for_device", "step_throughput", "token_loss_sum",
    "weight_decay_groups",
]
