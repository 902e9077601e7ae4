"""GRPO's rewards (tessera/eval/rewards.py): exact_numeric compares the completion's last number with
the record's answer; regex_format matches the whole completion; unit_tests runs the record's tests
against prompt + completion in the real code sandbox (HumanEval's layout, with and without an entry
point); a user's module:function gets the prompt, the completion and the record's other fields; a
reward that raises or gives no finite number scores 0 and is counted; a reward that cannot be loaded
is a ConfigError naming it."""

from __future__ import annotations

import math

import pytest

from tessera.config.errors import ConfigError
from tessera.config.grpo import GRPOConfig
from tessera.eval.rewards import exact_numeric, load_reward, regex_format, score


@pytest.mark.parametrize("completion,answer,want", [
    ("The sum is 7.", 7, 1.0), ("7.0", "7", 1.0), ("3 + 4 = 7", "#### 7", 1.0), ("-12", -12, 1.0),
    ("about 1,250", 1250, 1.0), ("7 or maybe 8", 7, 0.0), ("seven", 7, 0.0), ("", 7, 0.0),
])
def test_exact_numeric_compares_the_last_number_with_the_answer(completion, answer, want):
    assert exact_numeric("q", completion, answer=answer) == want


def test_regex_format_matches_the_whole_completion():
    reward = regex_format(r"<answer>\d+</answer>")
    assert reward("q", "<answer>42</answer>") == 1.0
    assert reward("q", "so <answer>42</answer>") == 0.0 and reward("q", "<answer>4x</answer>") == 0.0
    assert load_reward(GRPOConfig(reward="regex_format", format_pattern=r"\d.*"))("q", "3 apples") == 1.0
    with pytest.raises(ConfigError, match=r"train.grpo.format_pattern='\(' is invalid"):
        load_reward(GRPOConfig(reward="regex_format", format_pattern="("))


PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_unit_tests_run_in_the_sandbox():
    reward = load_reward(GRPOConfig(reward="unit_tests"))
    assert reward(PROMPT, "    return a + b\n", test=TEST, entry_point="add") == 1.0
    assert reward(PROMPT, "    return a - b\n", test=TEST, entry_point="add") == 0.0
    assert reward(PROMPT, "    return a + b\n", test="assert add(1, 1) == 2\n") == 1.0  # no entry point
    assert reward(PROMPT, "    return a * b\n", test="assert add(1, 1) == 2\n") == 0.0
    assert score(reward, PROMPT, "    return a + b\n", {"prompt": PROMPT}) == (0.0, True)  # no test: a failure


def test_a_user_reward_gets_the_records_fields_and_its_failures_score_0(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompt, completion, target, **fields):\n    return -abs(len(completion) - target)\n"
        "def broken(prompt, completion, **fields):\n    return 1 / 0\n"
        "def nan(prompt, completion, **fields):\n    return float('nan')\n"
        "def text(prompt, completion, **fields):\n    return 'high'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    record = {"prompt": "say five letters", "target": 5, "source": "test"}
    assert score(load_reward(GRPOConfig(reward="my_rewards:length")), record["prompt"], "abc", record) == (-2.0, False)
    for name in ("broken", "nan", "text"):
        value, failed = score(load_reward(GRPOConfig(reward=f"my_rewards:{name}")), "p", "c", record)
        assert value == 0.0 and failed and not math.isnan(value), name
    with pytest.raises(ConfigError, match=r"train.grpo.reward='my_rewards:absent' is invalid: module 'my_rewards' "
                                          r"has no function 'absent' \(one of exact_numeric"):
        load_reward(GRPOConfig(reward="my_rewards:absent"))
    with pytest.raises(ConfigError, match=r"train.grpo.reward='nowhere.at_all:f' is invalid: no module named "
                                          r"'nowhere'"):
        load_reward(GRPOConfig(reward="nowhere.at_all:f"))
