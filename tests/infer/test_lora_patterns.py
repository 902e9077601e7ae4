"""PEFT's rank_pattern / alpha_pattern keys of an adapter named at start-up are regular expressions
(runtime adapters may only use module names: test_lora_confinement.py): they run in linear time, so
one that backtracks for hours in Python's `re` loads at once, and an invalid one is a CheckpointError
naming the key. (The test's own time limit is the hang guard.)"""

from __future__ import annotations

import json
import shutil

import pytest

from tessera.checkpoint.loading import load_model
from tessera.config.errors import CheckpointError
from tessera.infer.runner.lora import read_adapter

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    """(the Tessera model, a PEFT adapter directory of rank 4 on it)."""
    from tests.infer.test_lora import make_adapter

    path = tmp_path_factory.mktemp("adapter") / "a"
    make_adapter(llama[0], "llama", path, seed=3)
    return load_model(llama[0]).model, path


def _with_patterns(source, path, **patterns):
    """A copy of adapter `source` at `path` with `patterns` in its adapter_config.json."""
    shutil.copytree(source, path)
    f = path / "adapter_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **patterns}))
    return path


def test_a_backtracking_pattern_key_loads_at_once(adapter, tmp_path):
    model, path = adapter
    plain = read_adapter(path, model)
    patterned = _with_patterns(path, tmp_path / "p", rank_pattern={"(.+)+!": 8, "layers\\.0\\..*_proj": 4},
                               alpha_pattern={"(.+)+!": 1.0})
    weights = read_adapter(patterned, model)
    assert weights.keys() == plain.keys() and all(weights[k].scale == plain[k].scale for k in plain)


@pytest.mark.parametrize("patterns, fragment", [
    ({"rank_pattern": {"(unclosed": 4}}, r"adapter_config.json: rank_pattern key '\(unclosed': .* is not a regular "
                                         "expression Tessera runs"),
    ({"alpha_pattern": {"(a)\\1": 4}}, "alpha_pattern key .* backreferences and lookarounds are not supported"),
])
def test_an_invalid_pattern_key_is_a_checkpoint_error_naming_it(adapter, tmp_path, patterns, fragment):
    model, path = adapter
    with pytest.raises(CheckpointError, match=fragment) as e:
        read_adapter(_with_patterns(path, tmp_path / "bad", **patterns), model)
    assert "\n" not in str(e.value)
