"""The registry of training modes (tessera/train/modes/registry.py): the config chooses the mode, and each
mode's step engine has the interface the one training loop calls."""

from __future__ import annotations

import inspect

from tessera.config.schema import load_config
from tessera.train.modes.dpo import DPOStep
from tessera.train.modes.eagle import EagleStep
from tessera.train.modes.registry import MODES, training_mode
from tessera.train.steps.step_engine import StepEngine
from tests.train.runs import TINY_DENSE

METHODS = ("forward_backward", "clip_grad_norm", "update_expert_bias", "evaluate")


def test_the_config_chooses_the_mode_and_the_language_model_mode_is_the_default():
    assert [m.name for m in MODES][-1] == "lm"
    assert training_mode(load_config(TINY_DENSE, ["train.device=cpu"])).name == "lm"
    eagle = load_config(TINY_DENSE, ["train.device=cpu", "train.eagle.target=runs/somewhere"])
    assert training_mode(eagle).name == "eagle"


def test_the_eagle_and_dpo_step_engines_have_the_interface_with_its_signatures():
    for engine in (EagleStep, DPOStep):
        for name in METHODS:
            want = list(inspect.signature(getattr(StepEngine, name)).parameters)
            assert list(inspect.signature(getattr(engine, name)).parameters) == want, (engine, name)
