"""Bad HuggingFace input gives typed errors that name the problem."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.config import CheckpointError, ModelError, get_preset
from tessera.hf import load_pretrained, save_pretrained
from tessera.models import Transformer


@pytest.fixture
def saved(tmp_path):
    model = Transformer(get_preset("tiny-llama"))
    save_pretrained(model, tmp_path / "m")
    return tmp_path / "m"


def _edit_config(path, **kw):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(kw)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_lists_supported(saved):
    _edit_config(saved, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelError, match=r"gpt2.*supported: llama, mistral"):
        load_pretrained(saved)


def test_missing_and_unexpected_tensors_are_named(saved):
    tensors = load_file(saved / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, saved / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        load_pretrained(saved)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, saved / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected.*model.layers.9.extra.weight"):
        load_pretrained(saved)


def test_shape_mismatch_names_key_and_shapes(saved):
    tensors = load_file(saved / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, saved / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"up_proj.weight.*\(100, 64\).*\(128, 64\)"):
        load_pretrained(saved)


def test_config_value_out_of_range_names_field(saved):
    _edit_config(saved, num_key_value_heads=3)
    with pytest.raises(Exception, match="n_kv_heads"):
        load_pretrained(saved)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_pretrained(tmp_path)


def test_export_refuses_what_hf_cannot_reproduce(tmp_path):
    cfg = get_preset("tiny-moe")
    cfg.moe.score_func = "sigmoid"
    with pytest.raises(ModelError, match="moe.score_func"):
        save_pretrained(Transformer(cfg), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_failed_save_keeps_previous_directory(saved, tmp_path):
    before = (saved / "model.safetensors").read_bytes()
    cfg = get_preset("tiny-moe")
    cfg.moe.expert_bias = True
    with pytest.raises(ModelError):
        save_pretrained(Transformer(cfg), saved)
    assert (saved / "model.safetensors").read_bytes() == before


def test_save_refuses_a_directory_with_foreign_files(saved):
    (saved / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="precious.txt"):
        save_pretrained(Transformer(get_preset("tiny-llama")), saved)
    assert (saved / "precious.txt").read_text() == "keep me"


def test_aux_loss_coefficient_converts_between_conventions(tmp_path):
    cfg = get_preset("tiny-moe")  # 2 layers, top-2, aux_loss_coef 0.01 per layer (Megatron's convention)
    save_pretrained(Transformer(cfg), tmp_path / "m")
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert hf["router_aux_loss_coef"] == pytest.approx(0.01 * cfg.n_layers / cfg.moe.top_k)
    assert load_pretrained(tmp_path / "m").cfg.moe.aux_loss_coef == pytest.approx(0.01)


def test_convert_refuses_a_non_empty_destination(saved, tmp_path):
    from tessera.checkpoint.convert import convert

    run = tmp_path / "run_checkpoints"
    run.mkdir()
    (run / "latest").write_text("step_00000100")
    with pytest.raises(CheckpointError, match="not empty"):
        convert(saved, run)
    assert (run / "latest").read_text() == "step_00000100"
