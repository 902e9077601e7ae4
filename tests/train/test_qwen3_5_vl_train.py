"""`tessera train` with data.kind=vision_sft from a transformers Qwen3.5 / Qwen3.5-MoE directory:
step 1's loss is transformers' answer-only cross-entropy on a batch of images of several sizes (the
hybrid language model's recurrent layers and interleaved M-RoPE in the training step), and a few
steps lower it."""

import pytest
import torch

from tessera.config.schema import load_config
from tessera.data.batching import BatchIterator
from tessera.models.vision.qwen3_vision import Qwen35VL
from tessera.train.trainer import Trainer
from tests.models.qwen3_5_vl_cases import FAMILIES, hf_qwen3_5_vl
from tests.models.qwen_vl_cases import hf_processor
from tests.train.test_qwen_vl_train import VOCAB, _hf_answer_loss, _losses, overrides


@pytest.mark.parametrize("family", FAMILIES)
def test_the_first_step_is_transformers_answer_loss_and_training_lowers_it(tmp_path, family):
    hf = hf_qwen3_5_vl(family, seed=2, vocab=VOCAB)
    hf.save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    bare = overrides(tmp_path / "run", 6, **{"train.init_from": tmp_path / "hf"})
    trainer = Trainer(load_config(None, bare + [
        "data.kind=vision_sft", "train.seq_len=64", "train.device=cpu", "train.global_batch_size=4",
        "train.micro_batch_size=4", "data.valid_fraction=0", "log.tensorboard=false", "optim.lr=3e-3",
        "optim.warmup_steps=1"]))
    model = trainer.model
    assert isinstance(model, Qwen35VL) and model.cfg.family == family
    # the whole model was read, the tower's learned positions included
    assert torch.equal(model.vision_tower.pos_embed.weight, hf.model.visual.pos_embed.weight)
    data = trainer.data.train
    batch = BatchIterator(data.dataset, data.global_batch_size, seed=data.seed).next_batch()
    want = _hf_answer_loss(hf, batch)
    losses = _losses(trainer.train())
    assert losses[0] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert sum(losses[-2:]) < sum(losses[:2])
    assert torch.isfinite(torch.tensor(losses)).all()
