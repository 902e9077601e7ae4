"""No code runs from a checkpoint: a crafted DCP `.metadata` or stored object is refused with a
CheckpointError through every entry point, trainer and RNG state are JSON (old pickled ones are
read with the restricted unpickler), and a HuggingFace index cannot point outside its directory."""

from __future__ import annotations

import json
import os
import pickle
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.reader import read_dcp_metadata
from tessera.checkpoint.dcp.restricted_unpickle import restricted_loads
from tessera.cli import main
from tessera.config import CheckpointError, get_preset
from tessera.hf import load_pretrained, save_pretrained
from tessera.infer import LLM
from tessera.models import Transformer
from tessera.train.run.rng_state import capture_rng_state, seed_everything
from tessera.train.run.train_checkpoint import layout_signature, load_training_state, model_and_optimizer_state
from tests.checkpoint.untrusted_checkpoints import RunsShellCommand, plant_code_in_metadata, small_checkpoint
from tests.train.runs import TINY_DENSE, build_small_dataset, set_args, shrink


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return build_small_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture
def crafted(tmp_path):
    """A checkpoint whose `.metadata` would create `marker` if unpickled; its checksum matches."""
    checkpoint = small_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "code-ran"
    plant_code_in_metadata(checkpoint, marker)
    return checkpoint, marker


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"tessera {command}: error: ") and err.count("\n") == 1, err
    return err


def test_crafted_metadata_is_refused_by_the_reader(crafted):
    checkpoint, marker = crafted
    with pytest.raises(CheckpointError, match="refused to load posix.system"):
        read_dcp_metadata(checkpoint)
    with pytest.raises(CheckpointError, match="refused to load posix.system"):
        ckpt.checkpoint_tensor_shapes(checkpoint)
    assert not marker.exists()


def test_crafted_metadata_through_generate_and_convert(crafted, tmp_path, capsys):
    checkpoint, marker = crafted
    assert main(["generate", str(checkpoint.parent), "--prompt", "x", "--max-new-tokens", "1"]) == 1
    assert "refused to load posix.system" in _one_error_line(capsys, "generate")
    assert main(["convert", str(checkpoint), str(tmp_path / "hf")]) == 1
    assert "refused to load posix.system" in _one_error_line(capsys, "convert")
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_crafted_metadata_through_the_server_loader(crafted, capsys):
    checkpoint, marker = crafted
    with pytest.raises(CheckpointError, match="refused to load posix.system"):
        LLM(checkpoint.parent, block_size=4)
    assert main(["serve", str(checkpoint.parent), "--port", "1"]) != 0  # refused before any socket opens
    assert "refused to load posix.system" in capsys.readouterr().err
    assert not marker.exists()


def test_crafted_metadata_through_init_from_and_resume(crafted, dataset, tmp_path, capsys):
    checkpoint, marker = crafted
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, run, 1, **{"train.init_from": str(checkpoint)}))]) == 1
    assert "refused to load posix.system" in _one_error_line(capsys, "train")
    assert not marker.exists()

    resumed = tmp_path / "resumed"
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, resumed, 2, **{"checkpoint.keep_last": 1}))]) == 0
    capsys.readouterr()
    plant_code_in_metadata(ckpt.find_latest(resumed / "checkpoints"), marker)
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, resumed, 4)), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "refused to load posix.system" in err and "no usable checkpoint" in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith("tessera train: error: ")
    assert not marker.exists()


def test_a_stored_object_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    state = {"model": {"w": torch.ones(2)}, "trainer": RunsShellCommand(f"touch {marker}")}
    path = ckpt.save_checkpoint(tmp_path / "ckpt", 1, state, {}, keep_last=1)  # a checksum that matches
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refused to load the stored object 'trainer'.*posix.system"):
        ckpt.load_checkpoint(path, {"model": {"w": torch.zeros(2)}, "trainer": ""})
    assert not marker.exists()


def _tiny_training_state(cfg_model):
    model = Transformer(cfg_model, init_seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    return model, optimizer


def test_old_pickled_trainer_and_rng_state_are_read_with_the_restricted_unpickler(tmp_path):
    from tessera.config.schema import RunConfig

    cfg = RunConfig(model=get_preset("tiny-llama"), run_dir=str(tmp_path))
    model, optimizer = _tiny_training_state(cfg.model)
    model_sd, optim_sd = model_and_optimizer_state([model], [optimizer])
    seed_everything(5)
    trainer = {"step": 3, "tokens_seen": 96, "scheduler": {"last_step": 3}, "data": {"index": 7}}
    old_state = {"model": model_sd, "optim": optim_sd, "trainer": pickle.dumps(trainer),
                 "rng": {"rank0": pickle.dumps(capture_rng_state())}}  # the format before JSON
    meta = {"config": cfg.to_dict(), "layout": layout_signature(cfg, 1)}
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", 3, old_state, meta, keep_last=1)
    expected = (random.random(), torch.rand(2))
    seed_everything(9)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert load_training_state(path, [model], [optimizer], shapes, cfg, 0, 1) == trainer
    assert (random.random(), torch.rand(2))[0] == expected[0]

    marker = tmp_path / "code-ran"
    old_state["trainer"] = pickle.dumps(RunsShellCommand(f"touch {marker}"))
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", 4, old_state, meta, keep_last=1)
    with pytest.raises(CheckpointError, match="trainer: refused to load posix.system"):
        load_training_state(path, [model], [optimizer], shapes, cfg, 0, 1)
    assert not marker.exists()


def test_new_checkpoints_hold_json_not_pickles(dataset, tmp_path):
    assert main(["train", TINY_DENSE, *set_args(shrink(dataset, tmp_path / "run", 2))]) == 0
    path = ckpt.find_latest(tmp_path / "run" / "checkpoints")
    state = {"trainer": "", "rng": {"rank0": ""}}
    ckpt.load_checkpoint(path, state)
    assert isinstance(state["trainer"], str) and json.loads(state["trainer"])["step"] == 2
    assert set(json.loads(state["rng"]["rank0"])) == {"python", "numpy", "torch"}


def test_restricted_unpickler_allows_plain_data_only():
    assert restricted_loads(pickle.dumps({"a": (1, 2.5, None, [b"x"])}), "legacy-state", "t") == {"a": (1, 2.5, None,
                                                                                                       [b"x"])}
    for obj in (RunsShellCommand("true"), os.getcwd, eval):
        with pytest.raises(CheckpointError, match="refused to load"):
            restricted_loads(pickle.dumps(obj), "legacy-state", "t")
    with pytest.raises(CheckpointError, match="cannot read"):
        restricted_loads(pickle.dumps({"a": 1})[:-3], "legacy-state", "t")


@pytest.fixture
def sharded_hf(tmp_path):
    """A HuggingFace directory whose weights are listed in model.safetensors.index.json."""
    path = tmp_path / "hf"
    save_pretrained(Transformer(get_preset("tiny-llama"), init_seed=0), path)
    names = list(load_file(path / "model.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "model.safetensors"
                                                                                   for k in names}}))
    assert load_pretrained(path) is not None
    return path, names


@pytest.mark.parametrize("target", ["../outside.safetensors", "ABSOLUTE", "link.safetensors"])
def test_index_pointing_outside_the_model_directory_is_refused(sharded_hf, target, tmp_path):
    path, names = sharded_hf
    outside = tmp_path / "outside.safetensors"
    save_file(load_file(path / "model.safetensors"), outside)
    if target == "ABSOLUTE":
        target = str(outside)
    elif target == "link.safetensors":
        (path / target).symlink_to(outside)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: target for k in names}}))
    with pytest.raises(CheckpointError, match="outside the model directory|not a relative path inside"):
        load_pretrained(path)
