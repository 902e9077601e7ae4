"""Qwen2-VL / Qwen2.5-VL directories: transformers' own directory loads (the files' layout and the
in-memory one), Tessera's export loads back into transformers' auto classes with the same logits
and, through AutoImageProcessor, the same pixel values; `tessera convert` goes to a checkpoint and
back; bad directories are refused by name."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.checkpoint.hf.qwen_vl import current_name, load_qwen_vl, save_qwen_vl
from tessera.config.errors import CheckpointError, ConfigError, ModelError
from tessera.data.qwen_image_processor import QwenImageProcessor
from tests.models.qwen_vl_cases import (
    MAX_PIXELS,
    MIN_PIXELS,
    VERSIONS,
    hf_inputs,
    hf_processor,
    hf_qwen_vl,
    mm_token_types,
    prompt_rows,
    sample_images,
)

transformers = pytest.importorskip("transformers")


def _logits(hf, ids, pixels, grids):
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                  mm_token_type_ids=mm_token_types(ids)).logits


@pytest.mark.parametrize("version", VERSIONS)
def test_export_loads_in_transformers_auto_classes(version, tmp_path):
    hf = hf_qwen_vl(version, tie=version == "qwen2_vl")
    hf.save_pretrained(tmp_path / "hf")
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    want = _logits(hf, ids, pixels, grids)
    model = load_qwen_vl(tmp_path / "hf")
    assert model.cfg.text.tie_embeddings == (version == "qwen2_vl")
    proc = QwenImageProcessor.for_vision(model.cfg.vision)
    proc.size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    save_qwen_vl(model, tmp_path / "out", processor=proc)
    written = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) == set(theirs)  # the names transformers' own save_pretrained writes
    for k, v in theirs.items():
        assert torch.equal(written[k], v), k
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    torch.testing.assert_close(_logits(back, ids, pixels, grids), want, atol=1e-4, rtol=1e-4)
    auto_proc = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out", backend="pil")
    got = auto_proc(sample_images(), return_tensors="np")
    values, grid_rows = proc.batch(sample_images())
    np.testing.assert_array_equal(got["pixel_values"], values)
    np.testing.assert_array_equal(got["image_grid_thw"], grid_rows)
    again = load_qwen_vl(tmp_path / "out")  # and Tessera reads its own export
    with torch.no_grad():
        torch.testing.assert_close(again(ids, pixel_values=pixels, image_grid_thw=grids).logits, want,
                                   atol=1e-4, rtol=1e-4)


def test_in_memory_tensor_names_load(tmp_path):
    hf = hf_qwen_vl("qwen2_5_vl")
    hf.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    renamed = {current_name(k): v for k, v in load_file(f).items()}  # model.language_model.*, model.visual.*
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, f, metadata={"format": "pt"})
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    with torch.no_grad():
        got = load_qwen_vl(tmp_path / "hf")(ids, pixel_values=pixels, image_grid_thw=grids).logits
    torch.testing.assert_close(got, _logits(hf, ids, pixels, grids), atol=1e-4, rtol=1e-4)


def test_bad_qwen_vl_directories_are_refused_by_name(tmp_path):
    hf_qwen_vl("qwen2_vl").save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    state = load_file(f)
    key = "visual.merger.mlp.0.weight"
    save_file({k: v for k, v in state.items() if k != key}, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing for qwen2_vl: model.visual.merger.mlp.0.weight"):
        load_qwen_vl(tmp_path / "hf")
    save_file({**state, key: state[key][:, :5].contiguous()}, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="shape mismatch for visual.merger.mlp.0.weight"):
        load_qwen_vl(tmp_path / "hf")
    cfg_file = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mrope_section=\[2, 2, 2\] is invalid: .* head_dim / 2 = 5"):
        load_qwen_vl(tmp_path / "hf")
    cfg["text_config"]["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "mrope_section": [1, 2, 2]}
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="only the default rotary frequencies"):
        load_qwen_vl(tmp_path / "hf")
    from tessera.checkpoint.hf.load import load_pretrained

    with pytest.raises(ConfigError, match="Qwen2-VL / Qwen2.5-VL .*load_qwen_vl"):
        load_pretrained(tmp_path / "hf")


def test_tessera_convert_round_trip_through_a_checkpoint(tmp_path, capsys):
    from tessera.cli import main as tessera_main

    hf = hf_qwen_vl("qwen2_5_vl", seed=2)
    hf.save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    want = _logits(hf, ids, pixels, grids)
    assert tessera_main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "step_00000000").is_dir()
    assert tessera_main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(back, ids, pixels, grids), want, atol=1e-4, rtol=1e-4)
    source = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    written = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    for key in ("size", "image_mean", "image_std", "resample", "rescale_factor", "patch_size", "merge_size",
                "temporal_patch_size"):
        assert written[key] == source[key], key
    capsys.readouterr()
    assert tessera_main(["convert", str(tmp_path / "hf"), str(tmp_path / "cut"), "--set", "parallel.tp=2"]) == 2
    assert "not supported for vision-language models (qwen2_vl, qwen2_5_vl)" in capsys.readouterr().err

