"""LLaVA directories: a transformers directory loads (its own layout and llava-hf's older one), and
Tessera's export loads back into transformers' auto classes with the same logits and, through
AutoImageProcessor, the same pixel values; bad directories are refused by name."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.checkpoint.hf.llava import current_name, load_llava, save_llava
from tessera.config.errors import CheckpointError, ModelError
from tessera.data.image_processor import ImageProcessor
from tests.models.llava_cases import hf_llava, hf_processor, prompt_rows, sample_images

transformers = pytest.importorskip("transformers")


def _inputs(hf):
    ids, _ = prompt_rows(hf)
    proc = hf_processor(hf)
    pixels = np.stack([proc(im, return_tensors="np")["pixel_values"][0] for im in sample_images()])
    return ids, torch.from_numpy(pixels)


@pytest.mark.parametrize("case", ["clip_llama_default", "siglip_qwen2_layers_full"])
def test_export_loads_in_transformers_auto_classes(case, tmp_path):
    hf = hf_llava(case)
    hf.save_pretrained(tmp_path / "hf")
    ids, pixels = _inputs(hf)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels).logits
    model = load_llava(tmp_path / "hf")
    proc = ImageProcessor.for_vision(model.cfg.vision)
    save_llava(model, tmp_path / "out", processor=proc)
    written = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) == set(theirs)  # the names transformers' own save_pretrained writes
    for k, v in theirs.items():
        assert torch.equal(written[k], v), k
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back).__name__ == "LlavaForConditionalGeneration"
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, pixel_values=pixels).logits, want, atol=1e-4, rtol=1e-4)
    auto_proc = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out", backend="pil")
    for image in sample_images():
        np.testing.assert_array_equal(auto_proc(image, return_tensors="np")["pixel_values"][0], proc(image))
    again = load_llava(tmp_path / "out")  # and Tessera reads its own export
    with torch.no_grad():
        torch.testing.assert_close(again(ids, pixel_values=pixels).logits, want, atol=1e-4, rtol=1e-4)


def test_llava_hf_older_tensor_names_load(tmp_path):
    hf = hf_llava("clip_llama_default")
    hf.save_pretrained(tmp_path / "hf")
    ids, pixels = _inputs(hf)
    state = load_file(tmp_path / "hf" / "model.safetensors")
    legacy = {}
    for k, v in state.items():  # whatever transformers wrote, renamed the way llava-hf's files name it
        k = current_name(k)
        for new, old in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                         ("model.vision_tower.", "vision_tower.vision_model."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            if k.startswith(new):
                k = old + k[len(new):]
                break
        legacy[k] = v
    assert any(k.startswith("vision_tower.vision_model.") for k in legacy)
    save_file(legacy, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        torch.testing.assert_close(load_llava(tmp_path / "hf")(ids, pixel_values=pixels).logits,
                                   hf(input_ids=ids, pixel_values=pixels).logits, atol=1e-4, rtol=1e-4)


def test_bad_llava_directories_are_refused_by_name(tmp_path):
    hf = hf_llava("clip_llama_default")
    hf.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    state = load_file(f)
    key = next(k for k in state if "multi_modal_projector.linear_1.weight" in k)
    save_file({k: v for k, v in state.items() if k != key}, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing for llava: .*multi_modal_projector.linear_1.weight"):
        load_llava(tmp_path / "hf")
    save_file({**state, key: state[key][:, :5].contiguous()}, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="shape mismatch for .*linear_1.weight"):
        load_llava(tmp_path / "hf")
    cfg_file = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["text_config"]["model_type"] = "gemma"
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="text_config model_type='gemma' is not supported"):
        load_llava(tmp_path / "hf")
    cfg["text_config"]["model_type"] = "llama"
    cfg["vision_feature_layer"] = 7
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="feature_layer=7 is invalid"):
        load_llava(tmp_path / "hf")


def test_tessera_convert_round_trip_through_a_checkpoint(tmp_path, capsys):
    from tessera.cli import main as tessera_main

    hf = hf_llava("siglip_mistral_default")
    hf.save_pretrained(tmp_path / "hf")
    hf_processor(hf).save_pretrained(tmp_path / "hf")
    ids, pixels = _inputs(hf)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels).logits
    assert tessera_main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "step_00000000").is_dir()
    assert tessera_main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, pixel_values=pixels).logits, want, atol=1e-4, rtol=1e-4)
    source = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    written = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    for key in ("size", "image_mean", "image_std", "resample", "rescale_factor"):
        assert written[key] == source[key], key
    capsys.readouterr()
    assert tessera_main(["convert", str(tmp_path / "hf"), str(tmp_path / "cut"), "--set", "parallel.tp=2"]) == 2
    assert "not supported for vision-language models (llava)" in capsys.readouterr().err
