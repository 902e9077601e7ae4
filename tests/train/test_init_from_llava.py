"""`train.init_from` takes a LLaVA directory: a text run whose model section is the LLaVA's language
model starts from exactly its weights (the vision tower and projector are not read), one process
and tensor parallel alike."""

import pytest
import torch

from tessera.checkpoint.hf.llava import save_llava
from tessera.config.errors import CheckpointError
from tessera.config.schema import load_config
from tessera.config.vision import LlavaConfig, VisionConfig
from tessera.models.vision.llava import Llava
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.parallel.trainer_runs import whole_parameters
from tests.train.runs import TINY_DENSE, shrink


def _llava_dir(small_dataset, tmp_path):
    text = load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "unused", 1)).model
    vision = VisionConfig(kind="siglip", image_size=20, patch_size=4, dim=16, n_layers=2, n_heads=2, ffn_dim=24)
    model = Llava(LlavaConfig(text=text, vision=vision, image_token_id=text.vocab_size - 1), init_seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape))  # norms off 1: a norm left unloaded shows
    save_llava(model, tmp_path / "llava")
    return model, tmp_path / "llava"


def test_a_text_run_starts_from_a_llava_language_model(small_dataset, tmp_path):
    model, path = _llava_dir(small_dataset, tmp_path)
    trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "run", 1,
                                                     **{"train.init_from": path, "train.seed": 7})))
    want = model.language_model.state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    # no model section: the model is the LLaVA's language model
    bare = [o for o in shrink(small_dataset, tmp_path / "bare", 1, **{"train.init_from": path})
            if not o.startswith("model.")]
    derived = Trainer(load_config(None, bare))
    for field in ("family", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta",
                  "max_seq_len", "tie_embeddings"):
        assert getattr(derived.cfg.model, field) == getattr(model.cfg.text, field), field
    for name, value in derived.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    with pytest.raises(CheckpointError, match="tok_embeddings.weight' has shape"):
        Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "bad", 1,
                                               **{"train.init_from": path, "model.dim": 96})))


def _tp_weights(config, overrides):
    trainer = Trainer(load_config(config, overrides))
    return whole_parameters(trainer.parts)


@pytest.mark.dist
def test_tensor_parallel_ranks_read_their_shards_of_a_llava_language_model(small_dataset, tmp_path):
    model, path = _llava_dir(small_dataset, tmp_path)
    overrides = shrink(small_dataset, tmp_path / "tp", 1, **{"train.init_from": path, "parallel.tp": 2,
                                                             "parallel.dp_shard": 1})
    weights = run_ranks(_tp_weights, 2, TINY_DENSE, overrides, timeout=HANG_S)[0]
    want = model.language_model.state_dict()
    for name, value in weights.items():
        assert torch.equal(value, want[name]), name
