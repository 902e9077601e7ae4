"""GRPO's rewards (train.grpo.reward): the built-in verifiers and a user's `module:function`.

A reward is called as `reward(prompt, completion, **fields_of_the_record) -> float`, where `prompt` is
the record's `prompt` field as the JSONL holds it (a string, or a list of messages), `completion` the
sampled text, and the keywords every other field of the record (tessera.data.prompts). Built in:

- `exact_numeric`: 1.0 when the last number in the completion equals the record's `answer` (a number,
  or text holding one; compared as numbers, so "4.0" matches 4), else 0.0.
- `regex_format`: 1.0 when the whole completion matches `train.grpo.format_pattern` (re.fullmatch,
  DOTALL), else 0.0.
- `unit_tests`: 1.0 when the program `prompt + completion`, then the record's `test`, then
  `check(<entry_point>)` when the record names one (HumanEval's layout: tessera.eval.humaneval) passes
  in the code sandbox (tessera.eval.sandbox), else 0.0. The sandbox is checked when the reward is made,
  so a machine that cannot isolate code stops the run before its first step.

`module:function` is imported from the working directory or PYTHONPATH when the reward is made; a
module or function that does not exist, or is not callable, is a ConfigError naming it. `score` calls a
reward for one completion: one that raises, or returns something that is not a finite number, gives
0.0 and is counted as a failure (the GRPO step logs `reward_failures`), and the run continues.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from tessera.config.errors import ConfigError
from tessera.config.grpo import BUILTIN_REWARDS, GRPOConfig
from tessera.eval.humaneval import check_program
from tessera.eval.sandbox import Sandbox, SandboxLimits

RewardFn = Callable[..., float]
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _number(text: Any) -> float | None:
    """The last number of `text` (a number is itself), or None when it holds none."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text)
    found = NUMBER.findall(str(text).replace(",", ""))
    return float(found[-1]) if found else None


def exact_numeric(prompt: Any, completion: str, answer: Any = None, **fields: Any) -> float:
    """1.0 when the completion's last number equals the record's `answer` (module docstring)."""
    if answer is None:
        raise ValueError("exact_numeric needs the record's 'answer' field")
    want, got = _number(answer), _number(completion)
    return float(want is not None and got is not None and math.isclose(got, want, rel_tol=0, abs_tol=1e-9))


def regex_format(pattern: str) -> RewardFn:
    """The reward of completions that match `pattern` whole (module docstring)."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompt: Any, completion: str, **fields: Any) -> float:
        return float(compiled.fullmatch(completion) is not None)
    return reward


class UnitTests:
    """The `unit_tests` reward: the record's tests run in the code sandbox (module docstring)."""

    def __init__(self, sandbox: Sandbox | None = None):
        self.sandbox = sandbox or Sandbox(SandboxLimits(timeout_s=10))
        self.sandbox.check()

    def __call__(self, prompt: Any, completion: str, test: str | None = None, entry_point: str | None = None,
                 **fields: Any) -> float:
        if not isinstance(prompt, str) or not isinstance(test, str):
            raise ValueError("unit_tests needs a string 'prompt' and the record's 'test' code")
        if entry_point is None:
            program = f"{prompt}{completion}\n{test}\n"
        else:
            program = check_program({"prompt": prompt, "test": test, "entry_point": entry_point}, completion)
        return float(self.sandbox.run(program).passed)


def load_reward(g: GRPOConfig) -> RewardFn:
    """The reward `train.grpo.reward` names, ready to call; ConfigError in one line when it cannot be."""
    if g.reward == "exact_numeric":
        return exact_numeric
    if g.reward == "regex_format":
        try:
            return regex_format(g.format_pattern)
        except re.error as e:
            raise ConfigError(f"train.grpo.format_pattern={g.format_pattern!r} is invalid: {e}") from None
    if g.reward == "unit_tests":
        return UnitTests()
    return _user_reward(g.reward)


def _user_reward(name: str) -> RewardFn:
    """`module:function` imported from the working directory or PYTHONPATH."""
    module_name, _, function = name.partition(":")
    allowed = (f"one of {', '.join(BUILTIN_REWARDS)} or module:function importable from the working directory or "
               "PYTHONPATH")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"train.grpo.reward={name!r} is invalid: no module named {e.name!r} ({allowed})") from None
    reward = getattr(module, function, None)
    if not callable(reward):
        raise ConfigError(f"train.grpo.reward={name!r} is invalid: module {module_name!r} has no function "
                          f"{function!r} ({allowed})")
    return reward


def score(reward: RewardFn, prompt: Any, completion: str, record: dict[str, Any]) -> tuple[float, bool]:
    """The reward of one completion, and whether it failed (raised, or gave no finite number: 0.0)."""
    fields = {k: v for k, v in record.items() if k != "prompt"}
    try:
        value = float(reward(prompt, completion, **fields))
    except Exception:  # a user's reward may fail any way; the sample scores 0 and the failure is counted
        return 0.0, True
    return (value, False) if math.isfinite(value) else (0.0, True)
