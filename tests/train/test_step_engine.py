"""The three step engines implement the one `StepEngine` interface the trainer calls."""

from __future__ import annotations

import inspect

import pytest
import torch

from tessera.config import get_preset
from tessera.models import Transformer
from tessera.train.steps.parallel_step import ParallelStep
from tessera.train.steps.pipeline_step import PipelineStep
from tessera.train.steps.single_process_step import SingleProcessStep
from tessera.train.steps.step_engine import StepEngine

METHODS = ("forward_backward", "clip_grad_norm", "update_expert_bias", "evaluate")


@pytest.mark.parametrize("engine", [SingleProcessStep, ParallelStep, PipelineStep])
def test_every_engine_has_the_interface_with_its_signatures(engine):
    for name in METHODS:
        want = list(inspect.signature(getattr(StepEngine, name)).parameters)
        assert list(inspect.signature(getattr(engine, name)).parameters) == want, (engine.__name__, name)


def test_single_process_engine_is_a_step_engine():
    model = Transformer(get_preset("tiny-llama"), init_seed=0)
    engine = SingleProcessStep(model, 2, 2, torch.device("cpu"), None)
    assert isinstance(engine, StepEngine)
    assert engine.parts == [model]
