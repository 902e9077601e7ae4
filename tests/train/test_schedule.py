"""Learning-rate schedules against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.config.schema import OptimConfig
from tessera.train.schedule import LRScheduler, lr_at


def cfg(**kw) -> OptimConfig:
    base = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10}
    return OptimConfig(**{**base, **kw})


def test_warmup_is_linear_from_lr_over_warmup():
    c = cfg(schedule="cosine")
    assert [lr_at(s, c, 110) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_hand_values():
    c = cfg(schedule="cosine")  # decay over steps 10..110 (100 steps)
    assert lr_at(10, c, 110) == pytest.approx(1.0)
    assert lr_at(60, c, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert lr_at(35, c, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_at(110, c, 110) == pytest.approx(0.1)
    assert lr_at(500, c, 110) == pytest.approx(0.1)  # the floor after the horizon


def test_linear_hand_values():
    c = cfg(schedule="linear")
    assert lr_at(35, c, 110) == pytest.approx(1.0 - 0.9 * 0.25)
    assert lr_at(110, c, 110) == pytest.approx(0.1)
    assert lr_at(111, c, 110) == pytest.approx(0.1)


def test_wsd_hand_values():
    c = cfg(schedule="wsd", decay_steps=20)  # stable until 90, linear to min_lr at 110
    assert lr_at(11, c, 110) == 1.0 and lr_at(90, c, 110) == 1.0
    assert lr_at(100, c, 110) == pytest.approx(0.55)
    assert lr_at(110, c, 110) == pytest.approx(0.1)
    default = cfg(schedule="wsd")  # decay_steps None: the last 20% of 110 = 22 steps
    assert lr_at(88, default, 110) == 1.0
    assert lr_at(99, default, 110) == pytest.approx(0.1 + 0.9 * (1 - 11 / 22))


def test_constant_and_no_warmup_and_explicit_horizon():
    assert lr_at(1000, cfg(schedule="constant"), 110) == 1.0
    c = cfg(schedule="linear", warmup_steps=0, total_steps=100)
    assert lr_at(1, c, 5) == pytest.approx(1.0 - 0.9 * 0.01)  # total_steps wins over train.steps
    assert lr_at(50, c, 5) == pytest.approx(0.55)


def test_scheduler_sets_every_group_and_round_trips():
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([{"params": [p1]}, {"params": [p2], "weight_decay": 0.0}], lr=5.0)
    sched = LRScheduler(opt, cfg(schedule="cosine"), 110)
    assert sched.set_step(5) == pytest.approx(0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.5])
    other = LRScheduler(opt, cfg(schedule="cosine"), 110)
    other.load_state_dict(sched.state_dict())
    assert other.last_step == 5
