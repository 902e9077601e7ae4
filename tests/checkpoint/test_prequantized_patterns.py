"""A pre-quantized directory's "re:" patterns (compressed-tensors `ignore` / `targets`) are untrusted
input: they run in linear time (one that backtracks for hours in Python's `re` loads at once) and an
invalid one is a CheckpointError naming the file and key. (The test's own time limit is the hang
guard.)"""

from __future__ import annotations

import pytest
import torch

from tessera.checkpoint.loading import load_model
from tessera.checkpoint.patterns import MAX_PATTERN_CHARS, pattern_matches
from tessera.config.errors import CheckpointError
from tests.checkpoint.quantized_checkpoints import edited_quantization_config, write_compressed

IDS = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(5))
BACKTRACKS = "(.+)+!"  # no module name has a '!': Python's re tries 2^len(name) ways before it says so


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    path = tmp_path_factory.mktemp("w8a8")
    write_compressed(path, "w8a8_dynamic")
    return path


def _edited(source, tmp_path, edit):
    tmp_path.mkdir(exist_ok=True)
    return edited_quantization_config(source, tmp_path / "edited", edit)


def test_a_catastrophic_pattern_is_matched_in_linear_time():
    assert not pattern_matches("(a+)+$", "a" * 100_000 + "!", "test")
    assert not pattern_matches(BACKTRACKS, "model.layers.0.self_attn.q_proj" * 100, "test")
    assert pattern_matches(r".*\.mlp\.(gate|up)_proj\Z", "model.layers.0.mlp.up_proj", "test")
    assert not pattern_matches(r"mlp", "model.layers.0.mlp.up_proj", "test")  # at the start, as re.match


def test_a_backtracking_ignore_pattern_loads_at_once(w8a8, tmp_path):
    plain = load_model(w8a8)
    path = _edited(w8a8, tmp_path, lambda qc: qc["ignore"].append("re:" + BACKTRACKS))
    loaded = load_model(path)
    assert sorted(loaded.quantized) == sorted(plain.quantized) and len(loaded.quantized) == 14
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(IDS).logits, plain.model(IDS).logits)


@pytest.mark.parametrize("edit, fragment", [
    (lambda qc: qc["ignore"].append("re:(unclosed"), r"config.json quantization_config.ignore\[1\]: '\(unclosed' is "
                                                      "not a regular expression Tessera runs \\(missing \\)"),
    (lambda qc: qc["config_groups"]["group_0"]["targets"].insert(0, "re:(a)\\1"),
     r"quantization_config.config_groups.group_0.targets\[0\]: .* backreferences and lookarounds are not supported"),
    (lambda qc: qc["ignore"].append("re:(?<=x)y"), r"ignore\[1\]: .*not a regular expression Tessera runs"),
    (lambda qc: qc["ignore"].append("re:" + "a" * (MAX_PATTERN_CHARS + 1)), rf"at most {MAX_PATTERN_CHARS} are read"),
    (lambda qc: qc["ignore"].append(7), r"quantization_config.ignore\[1\] must be a string, got int"),
    (lambda qc: qc.update(ignore="lm_head"), r"quantization_config.ignore must be a list of module names"),
    (lambda qc: qc["config_groups"].update(group_1=["Linear"]), r"config_groups.group_1 must be an object, got list"),
])
def test_invalid_patterns_are_checkpoint_errors_naming_the_key(w8a8, tmp_path, edit, fragment):
    with pytest.raises(CheckpointError, match=fragment) as e:
        load_model(_edited(w8a8, tmp_path, edit))
    assert "\n" not in str(e.value) and str(tmp_path / "edited") in str(e.value)
