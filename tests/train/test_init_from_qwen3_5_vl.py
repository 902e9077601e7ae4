"""`train.init_from` takes a Qwen3.5-MoE vision-language directory (transformers' own save: routed
experts one tensor each under `model.language_model.*`): a text run with no model section gets the
directory's qwen3_5_moe_text language model with exactly its weights, the vision tower unread."""

import torch

from tessera.checkpoint.hf.qwen3_5_vl import load_qwen3_5_vl
from tessera.config.schema import load_config
from tessera.train.trainer import Trainer
from tests.models.qwen3_5_vl_cases import hf_qwen3_5_vl
from tests.train.runs import shrink


def test_a_text_run_starts_from_a_qwen3_5_moe_language_model(small_dataset, tmp_path):
    hf_qwen3_5_vl("qwen3_5_moe", seed=8, vocab=4096).save_pretrained(tmp_path / "vl")
    model = load_qwen3_5_vl(tmp_path / "vl")
    bare = [o for o in shrink(small_dataset, tmp_path / "run", 1, **{"train.init_from": tmp_path / "vl"})
            if not o.startswith("model.")]
    trainer = Trainer(load_config(None, bare))
    assert trainer.cfg.model.family == "qwen3_5_moe_text"
    want = model.language_model.state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    ids = torch.randint(0, 4096, (2, 9))
    with torch.no_grad():  # on text the interleaved M-RoPE is plain RoPE: the text model is exact
        torch.testing.assert_close(trainer.model.eval()(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
