"""`tessera train` with data.kind=vision_sft from a transformers Qwen3.5 / Qwen3.5-MoE directory:
step 1's loss is transformers' answer-only cross-entropy on a batch of images of several sizes (the
hybrid language model's recurrent layers and interleaved M-RoPE in the training step), and a few
steps lower it; on gloo ranks dp_shard, tp, tp + sp, ep x dp_shard, cp, pp and (4 ranks) tp + sp x
dp_shard, (MoE) ep x tp x dp_shard and pp x dp_shard equal one process."""

import math

import pytest
import torch

from tessera.config.schema import load_config
from tessera.data.batching import BatchIterator
from tessera.models.vision.qwen3_vision import Qwen35VL
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.models.qwen3_5_vl_cases import FAMILIES, hf_qwen3_5_vl
from tests.models.qwen_vl_cases import hf_processor
from tests.parallel.trainer_runs import assert_merged_weights_equal, whole_parameters
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


def _settings(hf_dir, run_dir, steps, **layout):
    return overrides(run_dir, steps, **{"train.init_from": hf_dir}) + [
        "data.kind=vision_sft", "train.seq_len=64", "train.device=cpu", "train.global_batch_size=8",
        "train.micro_batch_size=2", "data.valid_fraction=0", "log.tensorboard=false", "checkpoint.interval=0",
        *(f"{k}={v}" for k, v in layout.items())]


def _train_on_ranks(settings):
    trainer = Trainer(load_config(None, settings))
    return {"losses": _losses(trainer.train()), "weights": whole_parameters(trainer.parts)}


LAYOUTS = {
    "dp_shard": ("qwen3_5", {"parallel.dp_shard": 2}),
    "tp": ("qwen3_5", {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "moe-ep-dp_shard": ("qwen3_5_moe", {"parallel.ep": 2, "parallel.dp_shard": 2}),
    "cp": ("qwen3_5", {"parallel.cp": 2, "parallel.dp_shard": 1}),
    "pp": ("qwen3_5", {"parallel.pp": 2, "parallel.dp_shard": 1}),
}
# sp's slices of the 64 tokens cut through the images' rows; the combined layouts take 4 ranks
SLOW_LAYOUTS = {
    "tp-sp": ("qwen3_5", {"parallel.tp": 2, "parallel.sp": "true", "parallel.dp_shard": 1}),
    "moe-tp-sp": ("qwen3_5_moe", {"parallel.tp": 2, "parallel.sp": "true", "parallel.dp_shard": 1}),
    "tp-sp-dp_shard": ("qwen3_5", {"parallel.tp": 2, "parallel.sp": "true", "parallel.dp_shard": 2}),
    "moe-ep-tp-dp_shard": ("qwen3_5_moe", {"parallel.ep": 2, "parallel.tp": 2, "parallel.dp_shard": 2}),
    "moe-pp-dp_shard": ("qwen3_5_moe", {"parallel.pp": 2, "parallel.dp_shard": 2}),
}


@pytest.mark.dist
@pytest.mark.parametrize("family, layout", [
    *(pytest.param(*case, id=name) for name, case in LAYOUTS.items()),
    *(pytest.param(*case, id=name, marks=pytest.mark.slow) for name, case in SLOW_LAYOUTS.items())])
def test_the_layouts_equal_one_process(tmp_path, family, layout):
    """The fine-tune's layouts over the hybrid language model (the DeltaNet's heads and channels cut
    under tp, sp's token slices gathered into whole rows for the recurrence, the experts under ep and
    ep x tp, the recurrent state handed between cp ranks, the tower on the first pipeline stage) and
    their combinations on 4 ranks equal one process: losses and weights after 3 steps (fp32 1e-5)."""
    hf_qwen3_5_vl(family, seed=3, vocab=VOCAB).save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    one = Trainer(load_config(None, _settings(tmp_path / "hf", tmp_path / "one", 3)))
    want_losses = _losses(one.train())
    want = {k: v.detach() for k, v in one.model.named_parameters()}
    world = math.prod(int(layout.get(f"parallel.{k}", 1)) for k in ("pp", "dp_shard", "cp", "tp"))
    got = run_ranks(_train_on_ranks, world, _settings(tmp_path / "hf", tmp_path / "ranks", 3, **layout),
                    timeout=HANG_S)
    assert got[0]["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-5)
    assert_merged_weights_equal(got, want)  # a pipeline's stages together
