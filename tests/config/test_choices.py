"""A name looked up in a table of choices: its value, or one ConfigError naming key, value and choices."""

import pytest

from tessera.config.choices import lookup_choice
from tessera.config.errors import ConfigError
from tessera.plan.activation_dtypes import get_activation_dtype
from tessera.plan.memory import get_precision


def test_a_known_name_gives_its_value():
    assert lookup_choice({"a": 1, "b": 2}, "b", "letter") == 2


def test_an_unknown_name_is_refused_naming_the_key_the_value_and_every_choice():
    with pytest.raises(ConfigError, match=r"^letter='c' is invalid: one of a, b$"):
        lookup_choice({"a": 1, "b": 2}, "c", "letter")


def test_the_planner_tables_refuse_unknown_names_the_same_way():
    allowed = "fp32, bf16, bf16-lowp-grads, bf16-lowp-moments"
    with pytest.raises(ConfigError, match=rf"^precision='fp8' is invalid: one of {allowed}$"):
        get_precision("fp8")
    with pytest.raises(ConfigError, match=r"^activation_dtype='fp16' is invalid: one of fp32, bf16, autocast-bf16$"):
        get_activation_dtype("fp16")
    assert get_activation_dtype("autocast-bf16").residual == 4
