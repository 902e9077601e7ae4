"""Learning-rate schedules: linear warm-up, then constant, cosine, linear or warmup-stable-decay.

Steps count optimizer updates from 1: `lr_at(1)` is the rate of the first update. With
W = warmup_steps, T = total steps, p = (step - W) / (T - W) clipped to [0, 1]:

- warm-up (step <= W):  lr * step / W
- constant:             lr
- cosine:               min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2   (Loshchilov & Hutter 2017, SGDR)
- linear:               min_lr + (lr - min_lr) * (1 - p)
- wsd:                  lr until T - D, then linear to min_lr over the last D steps
                        (warmup-stable-decay, Hu et al. 2024 "MiniCPM", section 4)

After T every schedule except `constant` stays at min_lr, the floor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tessera.config.errors import ConfigError
from tessera.config.run_checks import SCHEDULES
from tessera.config.schema import OptimConfig

WSD_DEFAULT_DECAY_FRACTION = 0.2  # share of total steps the wsd decay takes when decay_steps is None


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (1-based) under `cfg`."""
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is invalid: one of {', '.join(SCHEDULES)}")
    total = cfg.total_steps or total_steps
    warmup = cfg.warmup_steps
    if warmup > 0 and step <= warmup:
        return cfg.lr * step / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay = cfg.decay_steps if cfg.decay_steps is not None else round(WSD_DEFAULT_DECAY_FRACTION * total)
        decay = min(decay, max(total - warmup, 0))
        start = total - decay
        if step <= start:
            return cfg.lr
        p = min((step - start) / max(decay, 1), 1.0)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - p)
    p = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    if cfg.schedule == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - p)


class LRScheduler:
    """Sets every parameter group's rate to `lr_at(step)` before update `step`.

    The schedule is a pure function of the step, so the state is only the last step set; it is
    saved with the checkpoint to make a resumed run's first rate checkable against the original.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], cfg: OptimConfig,
                 total_steps: int) -> None:
        # Several optimizers when a rank holds several pipeline stages (one per stage module).
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.optimizer, self.cfg, self.total_steps = self.optimizers[0], cfg, total_steps
        self.last_step = 0

    def set_step(self, step: int) -> float:
        lr = lr_at(step, self.cfg, self.total_steps)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        self.last_step = step
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])
