"""Layer 6: the training loop, loss, optimizer, learning-rate schedules and metrics."""

from tessera.train.loss import count_loss_tokens, micro_batch_objective, token_loss_sum
from tessera.train.optimizer import build_optimizer, weight_decay_groups
from tessera.train.schedule import LRScheduler, lr_at
from tessera.train.step_engine import StepEngine
from tessera.train.throughput import peak_flops_for_device, step_throughput
from tessera.train.trainer import Trainer, TrainResult

__all__ = [
    "LRScheduler", "StepEngine", "TrainResult", "Trainer", "build_optimizer", "count_loss_tokens", "lr_at",
    "micro_batch_objective", "peak_flops_for_device", "step_throughput", "token_loss_sum",
    "weight_decay_groups",
]
