"""`tessera train` with data.kind=vision_sft: a LLaVA fine-tuned on image-text conversations in one
process. The first step's loss is the LLaVA's answer-only loss on the batch's images; frozen parts get
no gradient and no optimizer state and stay bit-identical; a resumed run equals an uninterrupted
one; a LLaVA directory is a starting point; dp_shard, dp_replicate and tp (with dp_shard too) on gloo ranks
equal one process (fp32, 1e-5); pipeline, context and expert parallelism are refused by name."""

import copy

import numpy as np
import pytest
import torch

from tessera.checkpoint.hf.llava import save_llava
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.data.batching import BatchIterator
from tessera.models.llava import Llava
from tessera.parallel.testing import run_ranks
from tessera.train.loss import IGNORE_INDEX, masked_targets
from tessera.train.trainer import Trainer
from tessera.train.vision_language import unused_tower_modules, vision_model_config
from tests.hang_guard import HANG_S
from tests.parallel.trainer_runs import whole_parameters
from tests.train.runs import ROOT

CONFIG = str(ROOT / "configs" / "tiny-llava.yaml")
DATA = str(ROOT / "examples" / "data" / "shapes" / "shapes.jsonl")


def overrides(run_dir, steps, **extra):
    values = {"run_dir": str(run_dir), "train.steps": steps, "log.progress_bar": "false", "train.log_interval": 1,
              "checkpoint.export_hf": "false", "data.datasets": f"[{{path: {DATA}}}]", **extra}
    return [f"{k}={v}" for k, v in values.items()]


def _trainer(run_dir, steps, resume=False, **extra):
    return Trainer(load_config(CONFIG, overrides(run_dir, steps, **extra)), resume=resume)


def _losses(result):
    return [r["loss"] for r in result.records if "loss" in r]


def test_the_first_step_is_the_llavas_answer_loss_on_the_batch_images(tmp_path):
    trainer = _trainer(tmp_path / "run", 1)
    start = copy.deepcopy(trainer.model).eval()
    data = trainer.data.train
    batch = BatchIterator(data.dataset, data.global_batch_size, seed=data.seed).next_batch()
    assert batch.pixel_values is not None and sum(len(p) for p in batch.pixel_values) > 0
    targets = masked_targets(batch.targets, batch.target_mask)

    def loss(pixels):
        with torch.no_grad():
            logits = start(batch.inputs, pixel_values=torch.cat(pixels)).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    want = float(loss(batch.pixel_values))
    [got] = _losses(trainer.train())
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    blank = float(loss([torch.zeros_like(p) for p in batch.pixel_values]))
    assert abs(blank - want) > 1e-4  # the images change the loss: they reached the model
    assert int((targets != IGNORE_INDEX).sum()) < int((batch.inputs != 0).sum()) // 2  # answers only


def _evaluate(run_overrides):
    trainer = Trainer(load_config(CONFIG, run_overrides))
    return trainer.evaluate()["val_loss"]


@pytest.mark.dist
def test_validation_loss_is_the_llavas_on_the_held_out_conversations_with_their_images(tmp_path):
    extra = {"data.valid_fraction": 0.25, "train.eval_interval": 1, "train.eval_steps": 1,
             "train.global_batch_size": 4, "train.micro_batch_size": 2}
    trainer = _trainer(tmp_path / "run", 1, **extra)
    held_out = trainer.data.valid.samples
    assert len(held_out) == 2 and len(held_out[0].pixels) == 1 and len(held_out[1].pixels) == 0
    tokens = torch.from_numpy(np.stack([s.tokens for s in held_out]))
    mask = torch.from_numpy(np.stack([s.loss_mask for s in held_out]))
    targets = masked_targets(tokens[:, 1:], mask[:, 1:])
    with torch.no_grad():
        trainer.model.eval()
        logits = trainer.model(tokens[:, :-1], pixel_values=torch.cat([torch.from_numpy(s.pixels)
                                                                       for s in held_out])).logits
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                   ignore_index=IGNORE_INDEX))
    assert trainer.evaluate()["val_loss"] == pytest.approx(want, rel=1e-6)
    # under dp_shard=2 the ranks split the rows, padding the short batch: the same loss
    layout = {"parallel.dp_shard": 2}
    got = run_ranks(_evaluate, 2, overrides(tmp_path / "ranks", 1, **extra, **layout), timeout=HANG_S)[0]
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("frozen", [("vision_tower",), ("projector",), ("language_model",),
                                    ("vision_tower", "language_model")])
def test_frozen_parts_stay_bit_identical_without_gradient_or_optimizer_state(tmp_path, frozen):
    switches = {f"train.vision_language.freeze_{p}": "true" for p in frozen}
    trainer = _trainer(tmp_path / "run", 3, **switches)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    # the tower's last block and final norm are past feature_layer=-2: never run, so never trained
    unused = {id(p) for m in unused_tower_modules(trainer.model) for p in m.parameters()}
    assert len(unused) == len(list(trainer.model.vision_tower.layers["1"].parameters())) + 2
    for name, p in trainer.model.named_parameters():
        if name.split(".")[0] in frozen or id(p) in unused:
            assert torch.equal(p, before[name]), name
            assert p.grad is None and not p.requires_grad and id(p) not in optimized, name
            assert p not in trainer.optimizer.state, name
        else:
            assert not torch.equal(p, before[name]), name


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    whole = _trainer(tmp_path / "whole", 4, **{"train.vision_language.freeze_projector": "true"})
    whole_losses = _losses(whole.train())
    first = _trainer(tmp_path / "cut", 2, **{"train.vision_language.freeze_projector": "true",
                                             "checkpoint.interval": 2})
    first.train()
    second = _trainer(tmp_path / "cut", 4, resume=True, **{"train.vision_language.freeze_projector": "true",
                                                           "checkpoint.interval": 2})
    assert second.step == 2
    assert _losses(second.train()) == whole_losses[2:]
    want = whole.model.state_dict()
    for name, value in second.model.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_a_llava_directory_is_the_starting_point(tmp_path):
    cfg = load_config(CONFIG, overrides(tmp_path / "unused", 1))
    llava_cfg, _ = vision_model_config(cfg)
    source = Llava(llava_cfg, init_seed=11)
    save_llava(source, tmp_path / "llava", tokenizer="default")
    bare = [o for o in overrides(tmp_path / "run", 1, **{"train.init_from": tmp_path / "llava"})]
    trainer = Trainer(load_config(None, bare + ["data.kind=vision_sft", "train.seq_len=64", "train.device=cpu",
                                                "train.global_batch_size=4", "train.micro_batch_size=2",
                                                "data.valid_fraction=0", "log.tensorboard=false"]))
    assert trainer.model.cfg == source.cfg  # the model section came from the directory too
    want = source.state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, want[name]), name


@pytest.mark.parametrize("settings, key", [(["train.fp8=true", "train.device=auto"], "train.fp8"),
                                           (["parallel.recompute=full"], "parallel.recompute"),
                                           (["train.distill.teacher=x"], "train.distill.teacher"),
                                           (["model.mtp_depth=1"], "model.mtp_depth")])
def test_what_vision_training_does_not_support_is_refused_by_name(tmp_path, settings, key):
    with pytest.raises(ConfigError, match=f"{key}=.*with vision-language fine-tuning"):
        load_config(CONFIG, overrides(tmp_path, 1) + settings)


@pytest.mark.parametrize("key", ["pp", "cp", "ep"])
def test_other_layouts_are_refused_by_name(tmp_path, key):
    with pytest.raises(ConfigError, match=f"parallel.{key}=2 is invalid: 1 with data.kind=vision_sft"):
        load_config(CONFIG, overrides(tmp_path, 1) + [f"parallel.{key}=2"])
    with pytest.raises(ConfigError, match="parallel.sp=True is invalid: false with vision-language"):
        load_config(CONFIG, overrides(tmp_path, 1) + ["parallel.tp=2", "parallel.sp=true"])
    with pytest.raises(ConfigError, match="parallel.optimizer='distributed' is invalid: fsdp with vision-language"):
        load_config(CONFIG, overrides(tmp_path, 1) + ["parallel.optimizer=distributed"])


def _train_on_ranks(run_overrides):
    trainer = Trainer(load_config(CONFIG, run_overrides))
    result = trainer.train()
    return {"losses": _losses(result), "weights": whole_parameters(trainer.parts)}


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"parallel.dp_shard": 2},
                                    {"parallel.dp_replicate": 2, "parallel.dp_shard": 1,
                                     "train.vision_language.freeze_vision_tower": "true"},
                                    {"parallel.tp": 2, "parallel.dp_shard": 1},
                                    {"parallel.tp": 2, "parallel.dp_shard": 2,
                                     "train.vision_language.freeze_language_model": "true"}])
def test_data_and_tensor_parallel_equal_one_process(tmp_path, layout):
    steps = {"train.global_batch_size": 8, "train.micro_batch_size": 2, "checkpoint.interval": 0}
    frozen = {k: v for k, v in layout.items() if "freeze" in k}
    one = _trainer(tmp_path / "one", 3, **steps, **frozen)
    want_losses = _losses(one.train())
    want = {k: v.detach() for k, v in one.model.named_parameters()}
    world = int(layout.get("parallel.tp", 1)) * int(layout.get("parallel.dp_shard", 1)) * int(
        layout.get("parallel.dp_replicate", 1))
    got = run_ranks(_train_on_ranks, world, overrides(tmp_path / "ranks", 3, **steps, **layout), timeout=HANG_S)[0]
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-5)
    assert set(got["weights"]) == set(want)
    for name, value in got["weights"].items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=name)


def _resume_on_ranks(run_overrides):
    trainer = Trainer(load_config(CONFIG, run_overrides), resume=True)
    start = trainer.step
    result = trainer.train()
    return {"start": start, "losses": _losses(result), "weights": whole_parameters(trainer.parts)}


@pytest.mark.dist
def test_a_one_process_checkpoint_resumes_under_dp_shard_and_tp(tmp_path):
    steps = {"train.global_batch_size": 8, "train.micro_batch_size": 2, "checkpoint.interval": 2}
    whole = _trainer(tmp_path / "whole", 4, **steps)
    want_losses = _losses(whole.train())
    _trainer(tmp_path / "cut", 2, **steps).train()
    layout = {"parallel.tp": 2, "parallel.dp_shard": 1}
    got = run_ranks(_resume_on_ranks, 2, overrides(tmp_path / "cut", 4, **steps, **layout), timeout=HANG_S)[0]
    assert got["start"] == 2
    assert got["losses"] == pytest.approx(want_losses[2:], rel=1e-5, abs=1e-5)
    for name, value in whole.model.named_parameters():
        torch.testing.assert_close(got["weights"][name], value.detach(), rtol=1e-5, atol=1e-5, msg=name)
