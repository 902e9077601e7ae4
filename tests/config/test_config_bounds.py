"""Configurations cannot exhaust the machine: strict YAML, finite numbers, bounded sizes.

Every refusal is one line naming the key and what is allowed, exit 2, and comes before any
allocation; real large configurations (LLaMA-3.1 405B, DeepSeek-V3) still load.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config.errors import ConfigError
from tessera.config.limits import MAX_YAML_NODES
from tessera.config.overrides import parse_override
from tessera.config.presets import PRESETS
from tessera.config.schema import config_from_dict, load_config
from tessera.config.yaml_text import load_yaml
from tessera.models.counting import count_params
from tests.hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-dense.yaml"


def _laughs(levels: int, fan_out: int = 10) -> str:
    """Nested aliases: `fan_out ** levels` values once expanded, a few hundred bytes as text."""
    lines = ["l0: &l0 {" + ", ".join(f"k{i}: 1" for i in range(fan_out)) + "}"]
    for level in range(1, levels + 1):
        refs = ", ".join(f"k{i}: *l{level - 1}" for i in range(fan_out))
        lines.append(f"l{level}: &l{level} {{{refs}}}")
    return "\n".join(lines) + f"\nmodel: {{preset: tiny-llama, rope_scaling: *l{levels}}}\n"


def _train_error(tmp_path: Path, capsys, config: Path, *overrides: str) -> str:
    """`tessera train` on `config`: exit 2, one line on stderr, nothing written; returns the line."""
    run_dir = tmp_path / "run"
    argv = ["train", str(config), "--set", f"run_dir={run_dir}"]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera train: error: ") and err.count("\n") == 1, err
    assert not run_dir.exists()
    return err


def _file(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_billion_laughs_is_refused_before_anything_expands():
    with pytest.raises(ConfigError, match=f"config c: expands to more than {MAX_YAML_NODES:,} values"):
        load_yaml(_laughs(9), "config c")
    assert load_yaml(_laughs(2), "config c")["l2"]["k9"]["k3"] == {f"k{i}": 1 for i in range(10)}


@pytest.mark.slow
def test_billion_laughs_is_refused_at_once_in_a_fresh_process(tmp_path):
    path = _file(tmp_path, _laughs(9))  # 10^9 values expanded: hours and all memory before the bound
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tessera", "train", str(path), "--set", f"run_dir={tmp_path / 'r'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert f"expands to more than {MAX_YAML_NODES:,} values" in run.stderr and "c.yaml" in run.stderr


def test_aliases_within_the_bound_still_work(tmp_path):
    anchored = _file(tmp_path, "optim: {lr: &lr 0.002, min_lr: *lr}\n"
                               "train: {steps: 3, seq_len: 64}\nmodel: {preset: tiny-llama}\n")
    cfg = load_config(anchored)
    assert cfg.optim.lr == cfg.optim.min_lr == 0.002 and cfg.train.seq_len == 64
    merge = _file(tmp_path, "model: {preset: tiny-llama, rope_scaling: {rope_type: linear, factor: 2.0}}\n"
                            "train: {steps: 3}\noptim:\n  <<: {lr: 0.001, min_lr: 0.0}\n  lr: 0.002\n")
    cfg = load_config(merge)  # a key given after a merge overrides it: not a duplicate
    assert cfg.optim.lr == 0.002 and cfg.optim.min_lr == 0.0
    assert cfg.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("text, message", [
    ("train: {steps: 3}\noptim:\n  lr: 0.001\n  lr: 0.1\n", r"key 'lr' appears twice in one section \(lines 3 and 4\)"),
    ("train: {steps: 3}\ntrain: {steps: 4}\n", r"key 'train' appears twice in one section \(lines 1 and 2\)"),
    ("optim: {no_decay: &x [a, *x]}\n", r"an alias refers to a section that contains it"),
    ("train: " + "[" * 70 + "]" * 70 + "\n", r"nested too deeply \(at most 64 levels"),
    ("train: " + "[" * 5000 + "]" * 5000 + "\n", r"nested too deeply"),
    (b"train:\n  steps: 3\n# caf\xe9\n", r"is not UTF-8 text \(byte 23 is b'\\xe9'\); save it as UTF-8"),
    (b"\xff\xfet\x00r\x00", r"is not UTF-8 text \(byte 0"),
    ("model: []\n", r"model must be a section \(preset: NAME, from_hf: DIR and/or fields\), got list \[\]"),
    ("model: 0\n", r"model must be a section"),
    ("[]\n", r"must hold a mapping of sections, got list"),
    ("false\n", r"must hold a mapping of sections, got bool"),
])
def test_bad_yaml_files_are_one_line_exit_2(text, message, tmp_path, capsys):
    err = _train_error(tmp_path, capsys, _file(tmp_path, text))
    assert re.search(message, err), err


def test_oversized_and_unreadable_files(tmp_path, capsys):
    big = _file(tmp_path, b"# " + b"x" * 2**20 + b"\n")
    assert "may hold at most 1,048,576" in _train_error(tmp_path, capsys, big)
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.yaml"
        locked.write_text("train: {steps: 3}\n")
        locked.chmod(0)
        assert "cannot be read: Permission denied" in _train_error(tmp_path, capsys, locked)


@pytest.mark.parametrize("override, message", [
    ("model.init_std=0", r"model.init_std=0.0 is invalid: must be a finite number > 0"),
    ("model.init_std=-0.02", r"model.init_std=-0.02 is invalid: must be a finite number > 0"),
    ("model.init_std=.nan", r"model.init_std=nan is invalid: must be a finite number"),
    ("model.init_std=nan", r"model.init_std='nan' is invalid: must be a finite number"),
    ("model.norm_eps=.inf", r"model.norm_eps=inf is invalid: must be a finite number"),
    ("train.seed=-1", r"train.seed=-1 is invalid: must be in 0..9223372036854775807"),
    ("train.seed=18446744073709551616", r"train.seed=18446744073709551616 is invalid: integers must fit 64 bits"),
    ("train.collective_timeout_s=.inf", r"train.collective_timeout_s=inf is invalid: must be a finite number"),
    ("train.collective_timeout_s=.nan", r"train.collective_timeout_s=nan is invalid: must be a finite number"),
    ("train.collective_timeout_s=-1", r"train.collective_timeout_s=-1.0 is invalid: must be in \(0, 604800\]"),
    ("train.collective_timeout_s=1e9", r"train.collective_timeout_s=1000000000.0 is invalid: must be in \(0, 604800\]"),
    ("optim.lr=.inf", r"optim.lr=inf is invalid: must be a finite number"),
    ("optim.lr=.nan", r"optim.lr=nan is invalid: must be a finite number"),
    ("optim.lr=1e999", r"optim.lr='1e999' is invalid: must be a finite number"),
    ("train.memory_budget_gib=.inf", r"train.memory_budget_gib=inf is invalid: must be a finite number"),
    ("data.datasets=[{path: a, weight: .inf}]", r"data.datasets\[0\].weight=inf is invalid: must be a finite"),
    ("train.steps=99999999999999999999999", r"train.steps=99999999999999999999999 is invalid: integers must fit"),
    ("train.device=cuda:abc", r"train.device='cuda:abc' is invalid: one of auto, cpu, cuda, cuda:N"),
    ("model=[]", r"model must be a section \(preset: NAME, from_hf: DIR and/or fields\), got list \[\]"),
    ("model.rope_scaling={rope_type: linear, factor: .inf}", r"model.rope_scaling.factor=inf is invalid"),
    ("model.rope_scaling={rope_type: linear, factor: true}", r"model.rope_scaling.factor=True is invalid"),
    ("model.rope_scaling={rope_type: linear, factor: 2, factor: 3}",
     r"override model.rope_scaling: key 'factor' appears twice"),
    ("optim.no_decay=&x [a, *x]", r"override optim.no_decay: an alias refers to a section that contains it"),
])
def test_bad_values_name_the_key_exit_2(override, message, tmp_path, capsys):
    err = _train_error(tmp_path, capsys, TINY, override)
    assert re.search(message, err), err


@pytest.mark.parametrize("override, message", [
    ("model.vocab_size=4194305", r"model.vocab_size=4194305 is invalid: must be an integer in 1..4,194,304"),
    ("model.dim=65537", r"model.dim=65537 is invalid: must be an integer in 1..65,536"),
    ("model.n_layers=1025", r"model.n_layers=1025 is invalid: must be an integer in 1..1,024"),
    ("model.n_heads=2048", r"model.n_heads=2048 is invalid: must be an integer in 1..1,024"),
    ("model.head_dim=8192", r"model.head_dim=8192 is invalid: .* at most 4,096"),
    ("model.ffn_dim=1000000000", r"model.ffn_dim=1000000000 is invalid: must be an integer in 1..262,144"),
    ("model.max_seq_len=16777217", r"model.max_seq_len=16777217 is invalid: must be an integer in 1..16,777,216"),
    ("model.sliding_window=16777217", r"model.sliding_window=16777217 is invalid"),
    ("train.micro_batch_size=16777217", r"train.micro_batch_size=16777217 is invalid: must be in 1..16,777,216"),
    ("train.global_batch_size=16777224", r"train.global_batch_size=16777224 is invalid: must be in 1..16,777,216"),
    ("train.global_batch_size=8388608", r"times train.seq_len=256 must be at most 1,073,741,824 tokens per step"),
    ("parallel.tp=1048577", r"parallel.tp=1048577 is invalid: must be an integer in 1..1,048,576"),
    ("parallel.dp_shard=1048577", r"parallel.dp_shard=1048577 is invalid"),
    ("parallel.microbatches=1048577", r"parallel.microbatches=1048577 is invalid"),
])
def test_sizes_are_bounded_before_allocation(override, message, tmp_path, capsys):
    err = _train_error(tmp_path, capsys, TINY, override)
    assert re.search(message, err), err


@pytest.mark.parametrize("section, message", [
    ({"preset": "tiny-moe", "moe": {"num_experts": 4097, "top_k": 2}}, r"model.moe.num_experts=4097 is invalid"),
    ({"preset": "tiny-moe", "moe": {"ffn_dim": 262145}}, r"model.moe.ffn_dim=262145 is invalid"),
    ({"preset": "tiny-moe", "moe": {"shared_ffn_dim": 262145}}, r"model.moe.shared_ffn_dim=262145 is invalid"),
    ({"preset": "tiny-moe", "moe": {"sinkhorn_iters": 10**6}}, r"model.moe.sinkhorn_iters=1000000 is invalid"),
    ({"preset": "tiny-moe", "moe": {"capacity_factor": float("inf")}}, r"capacity_factor=inf is invalid"),
    ({"preset": "tiny-deepseek", "mla": {"kv_lora_rank": 65537}}, r"model.mla.kv_lora_rank=65537 is invalid"),
    ({"preset": "tiny-deepseek", "mla": {"v_head_dim": 4097}}, r"model.mla.v_head_dim=4097 is invalid"),
])
def test_moe_and_mla_sizes_are_bounded(section, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": section})


def test_real_large_configurations_still_load():
    for name in ("llama3-8b", "mixtral-8x7b", "deepseek-v3"):
        load_config(ROOT / "configs" / f"{name}.yaml")
    llama_405b = ["model.preset=llama3.1-8b", "model.dim=16384", "model.n_layers=126", "model.n_heads=128",
                  "model.n_kv_heads=8", "model.ffn_dim=53248", "train.seq_len=8192", "train.micro_batch_size=1",
                  "train.global_batch_size=2048", "parallel.tp=8", "parallel.pp=16"]
    cfg = load_config(ROOT / "configs" / "llama3-8b.yaml", llama_405b)
    assert 400e9 < count_params(cfg.model) < 410e9
    assert len(PRESETS) >= 10  # every preset was validated when the module was imported


def test_override_values_use_the_strict_reader():
    assert parse_override("a.b={x: 1, y: [1, 2]}") == (["a", "b"], {"x": 1, "y": [1, 2]})
    assert parse_override("a.b=[unclosed") == (["a", "b"], "[unclosed")  # not YAML: stays text
    with pytest.raises(ConfigError, match="override a.b: key 'x' appears twice"):
        parse_override("a.b={x: 1, x: 2}")


GARBAGE = [-1, 0, float("nan"), float("inf"), -float("inf"), 1e300, 2**70, -(2**70), [], {}, "x", True, None, [1, 2]]


def _section_fields() -> list[tuple[str, str]]:
    import dataclasses

    from tessera.config.model import MLAConfig, ModelConfig, MoEConfig
    from tessera.config.schema import DistillConfig, RunConfig

    run = RunConfig()
    out = [(section, f.name) for section in ("train", "optim", "data", "checkpoint", "parallel", "log")
           for f in dataclasses.fields(getattr(run, section))]
    out += [("model", f.name) for f in dataclasses.fields(ModelConfig)]
    out += [(f"model.{sub}", f.name) for sub, cls in (("moe", MoEConfig), ("mla", MLAConfig))
            for f in dataclasses.fields(cls)]
    out += [("train.distill", f.name) for f in dataclasses.fields(DistillConfig)]
    return out


def test_every_field_refuses_garbage_with_a_config_error():
    """No value of any field ends in anything but a ConfigError (or a valid config)."""
    for section, name in _section_fields():
        for value in GARBAGE:
            raw: dict = {"model": {"preset": "tiny-deepseek"}}
            if section == "model":
                raw["model"][name] = value
            elif section.startswith("model."):
                raw["model"][section.split(".")[1]] = {name: value}
            elif section == "train.distill":
                raw["train"] = {"distill": {"teacher": "/a/teacher", name: value}}
            else:
                raw[section] = {name: value}
            try:
                config_from_dict(raw)
            except ConfigError:
                pass
            except Exception as e:  # noqa: BLE001 - the assertion names it
                raise AssertionError(f"{section}.{name}={value!r} raised {type(e).__name__}: {e}") from e
