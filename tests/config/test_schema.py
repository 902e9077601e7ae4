"""The run configuration: YAML + overrides, types, values, presets, documented defaults."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tessera.config.errors import ConfigError
from tessera.config.hf_config import config_to_hf, model_differences, read_hf_config
from tessera.config.overrides import apply_overrides, parse_override
from tessera.config.presets import get_preset
from tessera.config.schema import RunConfig, config_from_dict, load_config, save_config
from tessera.data import default_tokenizer
from tessera.models.counting import count_params

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "llama3-8b", "mixtral-8x7b", "deepseek-v3"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.run_dir == f"runs/{name}"
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0
    if name.startswith("tiny"):
        assert cfg.model.vocab_size == default_tokenizer().vocab_size
        assert 10e6 <= count_params(cfg.model) <= 30e6
        assert cfg.parallel.resolved_dp_shard(1) == 1  # runs on one process
    else:
        assert cfg.train.dtype == "bf16" and cfg.data.datasets


def test_tiny_configs_are_the_preset_families():
    assert load_config(CONFIGS / "tiny-dense.yaml").model.family == "llama"
    moe = load_config(CONFIGS / "tiny-moe.yaml").model
    assert moe.family == "mixtral" and moe.moe.num_experts == 8 and moe.moe.top_k == 2


def test_overrides_are_yaml_scalars():
    cfg = load_config(CONFIGS / "tiny-dense.yaml", ["train.steps=7", "optim.lr=3e-4", "train.init_from=null",
                                                    "optim.betas=[0.8, 0.9]", "train.dtype=bf16",
                                                    "log.tensorboard=false", "run_dir=/tmp/x"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 3e-4 and cfg.train.init_from is None
    assert cfg.optim.betas == (0.8, 0.9) and cfg.train.dtype == "bf16" and cfg.log.tensorboard is False
    assert cfg.run_dir == "/tmp/x"
    assert load_config(CONFIGS / "tiny-dense.yaml", ["run_dir=2024"]).run_dir == "2024"
    assert parse_override("a.b=c=d") == (["a", "b"], "c=d")
    assert apply_overrides({"a": {"b": 1}}, ["a.c.d=2"]) == {"a": {"b": 1, "c": {"d": 2}}}


def test_preset_plus_overrides_and_nested_sections():
    cfg = config_from_dict({"model": {"preset": "tiny-llama", "dim": 256, "n_heads": 8}})
    assert cfg.model.head_dim == 32  # derived from the overridden shape, not the preset's 16
    assert cfg.model.n_kv_heads == 2  # set explicitly by the preset: kept
    cfg = load_config(CONFIGS / "tiny-moe.yaml", ["model.moe.num_experts=4", "model.moe.top_k=1"])
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.aux_loss_coef == 0.01  # the rest is kept
    dense = config_from_dict({"model": {"preset": "tiny-moe", "moe": None, "family": "llama"}})
    assert dense.model.moe is None


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(CONFIGS / "deepseek-v3.yaml", ["train.steps=3"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert config_from_dict(RunConfig().to_dict()) == RunConfig()


@pytest.mark.parametrize("overrides, message", [
    (["train.stepz=3"], r"unknown key train.stepz \(did you mean train.steps\?\); allowed in train: steps"),
    (["model.moe.topk=3"], r"unknown key model.moe.topk \(did you mean model.moe.top_k\?\)"),
    (["data.datasets=[{path: a, wieght: 2}]"], r"unknown key data.datasets\[0\].wieght"),
    (["train.steps=ten"], r"train.steps='ten' has the wrong type: expected integer"),
    (["train.steps=1.5"], r"train.steps=1.5 has the wrong type: expected integer"),
    (["log.tensorboard=3"], r"log.tensorboard=3 has the wrong type: expected boolean"),
    (["optim.betas=[0.9]"], r"optim.betas=\[0.9\] has the wrong type: expected a list of 2 values"),
    (["train.init_from=[1]"], r"train.init_from=\[1\] has the wrong type: expected string or null"),
    (["train"] , r"override 'train' is malformed"),
    (["train.steps.x=1"], r"train.steps is a int, not a section"),
    (["train.steps=0"], r"train.steps=0 is invalid: must be >= 1"),
    (["train.global_batch_size=12"], r"train.global_batch_size=12 is invalid: must be a positive multiple of "
                                     r"train.micro_batch_size=8"),
    (["train.dtype=fp8"], r"train.dtype='fp8' is invalid: one of fp32, bf16, fp16"),
    (["train.compile=3"], r"train.compile=3 has the wrong type: expected boolean or null"),
    (["train.seq_len=4096"], r"train.seq_len=4096 is invalid: must be <= model.max_seq_len=256"),
    (["optim.min_lr=1"], r"optim.min_lr=1.0 is invalid: must be in \[0, optim.lr=0.001\]"),
    (["optim.schedule=step"], r"optim.schedule='step' is invalid: one of constant, cosine, linear, wsd"),
    (["checkpoint.keep_last=0"], r"checkpoint.keep_last=0 is invalid: must be >= 1"),
    (["data.valid_fraction=0"], r"train.eval_interval=50 is invalid: must be 0 when data.valid_fraction is 0"),
    (["model.n_kv_heads=4"], r"model.n_kv_heads=4 is invalid: must be positive and divide n_heads=6"),
    (["model.preset=tiny-lama"], r"model.preset: unknown model name 'tiny-lama'"),
    (["parallel.tp=0"], r"parallel.tp=0 is invalid"),
])
def test_errors_name_the_key_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "tiny-dense.yaml", overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "section.yaml").write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train must be a section"):
        load_config(tmp_path / "section.yaml")


def test_every_field_is_documented():
    import dataclasses
    import inspect

    from tessera.config import schema

    source = inspect.getsource(schema)
    for cls in (schema.TrainConfig, schema.OptimConfig, schema.DataConfig, schema.DatasetEntry,
                schema.CheckpointConfig, schema.LogConfig, schema.DistillConfig):
        lines = inspect.getsource(cls).splitlines()
        for f in dataclasses.fields(cls):
            i = next(n for n, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
            assert "#" in lines[i] or lines[i - 1].strip().startswith("#"), f"{cls.__name__}.{f.name}"
    assert source


def _hf_dir(path: Path, preset: str) -> Path:
    """A HuggingFace model directory's config.json (no weights: the config alone names the model)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_to_hf(get_preset(preset))))
    return path


def test_model_from_a_huggingface_config(tmp_path):
    hf = _hf_dir(tmp_path / "mixtral", "mixtral-8x7b")
    expected = read_hf_config(hf)
    assert expected.family == "mixtral" and expected.moe.num_experts == 8 and expected.n_kv_heads == 8
    assert load_config(None, [f"model.from_hf={hf}"]).model == expected
    (tmp_path / "run.yaml").write_text(f"model:\n  from_hf: {hf}\n  n_layers: 2\n  moe: {{num_experts: 4}}\n")
    small = load_config(tmp_path / "run.yaml").model
    assert small.n_layers == 2 and small.moe.num_experts == 4  # overridden ...
    assert small.moe.top_k == expected.moe.top_k and small.dim == expected.dim  # ... the rest is the directory's
    # a preset in the file gives way when dropped on the command line; the file's fields still override
    swapped = load_config(CONFIGS / "tiny-dense.yaml", ["model.preset=null", f"model.from_hf={hf}"]).model
    assert swapped.family == "mixtral" and swapped.moe == expected.moe and swapped.rope_theta == expected.rope_theta
    assert swapped.dim == 384 and swapped.n_layers == 6


def test_no_model_section_takes_the_model_train_init_from_holds(tmp_path):
    hf = _hf_dir(tmp_path / "deepseek", "deepseek-v3")
    assert load_config(None, [f"train.init_from={hf}"]).model == read_hf_config(hf)
    (tmp_path / "empty_model.yaml").write_text(f"model:\ntrain:\n  init_from: {hf}\n")
    assert load_config(tmp_path / "empty_model.yaml").model == read_hf_config(hf)
    # fields given beside it override the directory's, also with the preset dropped
    want = dataclasses.replace(read_hf_config(hf), max_seq_len=512)
    for extra in (["model.max_seq_len=512"], ["model.preset=null", "model.max_seq_len=512"]):
        assert load_config(None, [f"train.init_from={hf}", *extra]).model == want
    # a preset is the user's word: kept (the trainer's shape check refuses a mismatch)
    assert load_config(CONFIGS / "tiny-dense.yaml", [f"train.init_from={hf}"]).model.family == "llama"
    assert load_config(None, [f"train.init_from={tmp_path}"]).model == RunConfig().model  # not a HF directory


def test_model_from_hf_errors_name_the_key(tmp_path):
    hf = _hf_dir(tmp_path / "llama", "llama3-8b")
    with pytest.raises(ConfigError, match=r"model.preset='tiny-llama' and model.from_hf='.*llama' both name a "
                                          r"model: give one \(model.preset=null drops the preset\)"):
        load_config(CONFIGS / "tiny-dense.yaml", [f"model.from_hf={hf}"])
    with pytest.raises(ConfigError, match=r"model.from_hf='.*nowhere' is invalid: no config.json there"):
        load_config(None, [f"model.from_hf={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=r"model.from_hf=3 is invalid: must be a HuggingFace model directory"):
        load_config(None, ["model.from_hf=3"])
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10, "hidden_size": 8,
                                                 "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(ConfigError, match=r"model.from_hf='.*gpt2': unsupported architecture model_type='gpt2'"):
        load_config(None, [f"model.from_hf={bad}"])
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model.from_hf='.*gpt2': .*config.json' is not valid JSON"):
        load_config(None, [f"model.from_hf={bad}"])
    with pytest.raises(ConfigError, match=r"^train.init_from='.*gpt2': .*config.json' is not valid JSON"):
        load_config(None, [f"train.init_from={bad}"])  # the key the user wrote is named


def test_fields_given_still_describe_the_model_when_config_json_cannot_be_read(tmp_path):
    bad = tmp_path / "variant"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama-variant", "vocab_size": 10, "hidden_size": 8,
                                                 "num_hidden_layers": 1, "num_attention_heads": 2}))
    cfg = load_config(CONFIGS / "tiny-dense.yaml", ["model.preset=null", f"train.init_from={bad}"])
    assert cfg.model.dim == 384 and cfg.model.family == "llama"  # the file's fields, as without init_from
    with pytest.raises(ConfigError, match=r"^train.init_from='.*variant': unsupported architecture"):
        load_config(None, [f"train.init_from={bad}"])  # nothing else describes the model


def test_model_differences_put_shapes_apart():
    mine = get_preset("tiny-moe")
    theirs = dataclasses.replace(mine, dim=mine.dim * 2, rope_theta=1.0,
                                 moe=dataclasses.replace(mine.moe, z_loss_coef=0.0, num_experts=4))
    shapes = model_differences(mine, theirs, shapes_only=True)
    assert shapes == [f"dim ({mine.dim} here, {mine.dim * 2} there)",
                      f"moe.num_experts ({mine.moe.num_experts} here, 4 there)"]
    everything = model_differences(mine, theirs)
    assert set(shapes) < set(everything) and any(d.startswith("moe.z_loss_coef") for d in everything)
    assert any(d.startswith("rope_theta") for d in everything)
