"""Qwen3.5 / Qwen3.5-MoE vision-language directories: transformers' own directory loads, Tessera's
export holds the names transformers' `save_pretrained` writes (routed experts one tensor each) and
loads back into transformers' auto classes with the same logits; `tessera convert` goes to a
checkpoint and back; the multi-token-prediction layers of the published files are left unread and
any other stray tensor is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.checkpoint.hf.qwen3_5_vl import load_qwen3_5_vl, save_qwen3_5_vl
from tessera.config.errors import CheckpointError, ConfigError
from tests.models.qwen3_5_vl_cases import FAMILIES, hf_qwen3_5_vl
from tests.models.qwen_vl_cases import hf_inputs, hf_processor, mm_token_types, prompt_rows

transformers = pytest.importorskip("transformers")


def _logits(hf, ids, pixels, grids):
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                  mm_token_type_ids=mm_token_types(ids)).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_auto_classes(family, tmp_path):
    tie = family == "qwen3_5"
    hf = hf_qwen3_5_vl(family, seed=3, tie=tie)
    hf.save_pretrained(tmp_path / "hf")
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    want = _logits(hf, ids, pixels, grids)
    model = load_qwen3_5_vl(tmp_path / "hf")
    assert model.cfg.text.tie_embeddings == tie and model.family == family
    save_qwen3_5_vl(model, tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) == set(theirs)  # the names transformers' own save_pretrained writes
    for k, v in theirs.items():
        assert torch.equal(written[k], v), k
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    torch.testing.assert_close(_logits(back, ids, pixels, grids), want, atol=1e-4, rtol=1e-4)
    again = load_qwen3_5_vl(tmp_path / "out")  # and Tessera reads its own export
    assert again.cfg == model.cfg
    # no processor given: the tower's own, normalizing as transformers' Qwen3-VL processors do
    written_proc = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert written_proc["image_mean"] == written_proc["image_std"] == [0.5, 0.5, 0.5]
    assert written_proc["patch_size"] == 4
    with torch.no_grad():
        torch.testing.assert_close(again(ids, pixel_values=pixels, image_grid_thw=grids).logits, want,
                                   atol=1e-4, rtol=1e-4)


def test_mtp_layers_are_left_unread_and_stray_tensors_refused(tmp_path):
    hf = hf_qwen3_5_vl("qwen3_5", seed=5)
    hf.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(f)
    save_file({**tensors, "mtp.fc.weight": torch.ones(32, 64), "mtp.norm.weight": torch.ones(32)}, f,
              metadata={"format": "pt"})
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    with torch.no_grad():
        got = load_qwen3_5_vl(tmp_path / "hf")(ids, pixel_values=pixels, image_grid_thw=grids).logits
    torch.testing.assert_close(got, _logits(hf, ids, pixels, grids), atol=1e-4, rtol=1e-4)
    save_file({**tensors, "model.visual.extra.weight": torch.ones(2)}, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\) for qwen3_5: model.visual.extra.weight"):
        load_qwen3_5_vl(tmp_path / "hf")
    save_file({k: v for k, v in tensors.items() if k != "model.visual.pos_embed.weight"}, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing for qwen3_5: model.visual.pos_embed.weight"):
        load_qwen3_5_vl(tmp_path / "hf")
    from tessera.checkpoint.hf.load import load_pretrained

    with pytest.raises(ConfigError, match=r"Qwen3.5 / Qwen3.5-MoE .*load_qwen3_5_vl"):
        load_pretrained(tmp_path / "hf")


def test_tessera_convert_round_trip_through_a_checkpoint(tmp_path):
    from tessera.cli import main as tessera_main

    hf = hf_qwen3_5_vl("qwen3_5_moe", seed=6)
    hf.save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    want = _logits(hf, ids, pixels, grids)
    assert tessera_main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "step_00000000").is_dir()
    assert tessera_main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5MoeForConditionalGeneration"
    torch.testing.assert_close(_logits(back, ids, pixels, grids), want, atol=1e-4, rtol=1e-4)
    source = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    written = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    for key in ("size", "image_mean", "image_std", "patch_size", "merge_size", "temporal_patch_size"):
        assert written[key] == source[key], key
