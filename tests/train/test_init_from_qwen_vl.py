"""`train.init_from` takes a Qwen2-VL / Qwen2.5-VL directory: a text run whose model is the directory's
qwen2 language model starts from exactly its weights (the vision tower is not read), one process and
tensor parallel alike. On text the M-RoPE positions are plain positions, so the text model is exact."""

import pytest
import torch

from tessera.checkpoint.hf.qwen_vl import save_qwen_vl
from tessera.config.qwen_vl import QwenVisionConfig, QwenVLConfig
from tessera.config.schema import load_config
from tessera.models.vision.qwen_vl import QwenVL
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.parallel.trainer_runs import whole_parameters
from tests.train.runs import TINY_DENSE, shrink

QWEN2 = {"model.family": "qwen2", "model.qkv_bias": True}


def _qwen_vl_dir(small_dataset, tmp_path, version="qwen2_5_vl"):
    text = load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "unused", 1, **QWEN2)).model
    vision = QwenVisionConfig(version=version, dim=16, n_layers=2, n_heads=2, ffn_dim=32, out_dim=text.dim,
                              patch_size=4, window_size=16, fullatt_blocks=[1], act="silu")
    cfg = QwenVLConfig(text=text, vision=vision, image_token_id=text.vocab_size - 1, mrope_section=[2, 3, 3])
    model = QwenVL(cfg, init_seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape))  # norms off 1, biases off 0: one left unloaded shows
    save_qwen_vl(model, tmp_path / "qwen_vl")
    return model, tmp_path / "qwen_vl"


def test_a_text_run_starts_from_a_qwen_vl_language_model(small_dataset, tmp_path):
    model, path = _qwen_vl_dir(small_dataset, tmp_path)
    trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "run", 1,
                                                     **{**QWEN2, "train.init_from": path, "train.seed": 7})))
    want = model.language_model.state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    # no model section: the model is the directory's language model
    bare = [o for o in shrink(small_dataset, tmp_path / "bare", 1, **{"train.init_from": path})
            if not o.startswith("model.")]
    derived = Trainer(load_config(None, bare))
    for field in ("family", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta",
                  "qkv_bias", "tie_embeddings"):
        assert getattr(derived.cfg.model, field) == getattr(model.cfg.text, field), field
    for name, value in derived.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    ids = torch.randint(0, 200, (2, 9))
    with torch.no_grad():  # the text model's logits are the vision-language model's on text
        torch.testing.assert_close(derived.model.eval()(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=1e-5)


def _tp_weights(config, overrides):
    trainer = Trainer(load_config(config, overrides))
    return whole_parameters(trainer.parts)


@pytest.mark.dist
def test_tensor_parallel_ranks_read_their_shards_of_a_qwen_vl_language_model(small_dataset, tmp_path):
    model, path = _qwen_vl_dir(small_dataset, tmp_path, "qwen2_vl")
    overrides = shrink(small_dataset, tmp_path / "tp", 1, **{**QWEN2, "train.init_from": path, "parallel.tp": 2,
                                                             "parallel.dp_shard": 1})
    weights = run_ranks(_tp_weights, 2, TINY_DENSE, overrides, timeout=HANG_S)[0]
    want = model.language_model.state_dict()
    for name, value in weights.items():
        assert torch.equal(value, want[name]), name
