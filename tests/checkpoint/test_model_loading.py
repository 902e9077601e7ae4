"""Loading a Tessera training checkpoint for serving: the model comes back from the weights alone,
whatever else (optimizer state, trainer state) the trainer wrote beside them. The one loader reads
every kind of model directory, and says where the tokenizer a model was trained with is."""

import pickle

import pytest
import torch

from tessera.checkpoint.dcp.store import save_checkpoint
from tessera.hf import load_pretrained
from tessera.infer import LLM, SamplingParams
from tests.infer.tiny_models import hf_greedy, write_model


def test_serves_a_tessera_training_checkpoint(tmp_path):
    path = tmp_path / "hf"
    hf = write_model(path, "llama", std=0.25)
    model = load_pretrained(path)
    meta = {"config": {"model": model.cfg.to_dict(), "data": {"tokenizer": str(path)}}, "layout": {}}
    state = {"model": model.state_dict(), "optim": {"state.tok_embeddings.weight.exp_avg": torch.zeros(3)},
             "trainer": pickle.dumps({"step": 7})}  # what the trainer writes besides the weights
    save_checkpoint(tmp_path / "run" / "checkpoints", 7, state, meta, keep_last=1)
    llm = LLM(tmp_path / "run", block_size=4)
    out = llm.generate(["from a checkpoint"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(hf, llm.tokenizer.encode("from a checkpoint"), 10)
    assert torch.equal(llm.engine.model.tok_embeddings.weight, model.tok_embeddings.weight)


def test_one_loader_reads_every_kind_of_model_directory_and_says_where_its_tokenizer_is(tmp_path):
    from tessera.checkpoint.dcp.model import save_model_checkpoint
    from tessera.checkpoint.int8 import save_quantized
    from tessera.checkpoint.loading import load_model, trained_tokenizer
    from tessera.config import CheckpointError, get_preset
    from tessera.hf import save_pretrained
    from tessera.models import Transformer
    from tessera.models.quantized import quantize_model

    hf = tmp_path / "hf"
    write_model(hf, "llama")
    whole = load_model(hf)
    assert (whole.quantized, whole.run_config) == (None, None) and not whole.model.training
    assert trained_tokenizer(hf) == str(hf)

    layers = quantize_model(whole.model)
    save_quantized(whole.model, layers, tmp_path / "int8", source_dir=hf)
    quantized = load_model(tmp_path / "int8")
    assert quantized.quantized == layers and trained_tokenizer(tmp_path / "int8") == str(tmp_path / "int8")

    save_model_checkpoint(Transformer(get_preset("tiny-llama")), tmp_path / "run" / "checkpoints")
    model, layers, run_config = load_model(tmp_path / "run")
    assert layers is None and run_config["model"] == get_preset("tiny-llama").to_dict()
    assert trained_tokenizer(tmp_path / "run") == "default"  # data.tokenizer unset: the bundled one
    (tmp_path / "run" / "tokenizer.json").write_bytes((hf / "tokenizer.json").read_bytes())
    assert trained_tokenizer(tmp_path / "run") == str(tmp_path / "run")  # a tokenizer copied in wins

    save_pretrained(model, tmp_path / "bare")  # no tokenizer given: none in the directory
    assert trained_tokenizer(tmp_path / "bare") is None
    assert load_model(tmp_path / "run" / "checkpoints").run_config == run_config  # a checkpoint root too
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a HuggingFace model directory .* nor a Tessera checkpoint"):
        load_model(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_a_read_lets_its_file_pages_go(tmp_path, monkeypatch):
    """Each tensor read from a HuggingFace directory closes its file's mapping after it (the pages it
    touched stop counting in resident memory, so reading a model costs one tensor's, not the file's),
    and the next read opens the file again: the model loads whole, equal to its source."""
    from tessera.checkpoint.hf.files import SafetensorsDir

    path = tmp_path / "hf"
    hf = write_model(path, "llama")
    released, opened = [], []
    original_release, original_handle = SafetensorsDir.release, SafetensorsDir.handle
    monkeypatch.setattr(SafetensorsDir, "release", lambda self, f: released.append(f) or original_release(self, f))
    monkeypatch.setattr(SafetensorsDir, "handle", lambda self, f: opened.append(f in self._open) or
                        original_handle(self, f))
    model = load_pretrained(path)
    # one release per tensor read; every read after the first (whose file the shape checks opened) opens anew
    assert len(released) == len(model.state_dict()) and not any(opened[-len(released) + 1:])
    torch.testing.assert_close(model.output.weight, hf.lm_head.weight, rtol=0, atol=0)
