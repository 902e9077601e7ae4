"""`tessera train` with data.kind=vision_sft: a LLaVA fine-tuned on image-text conversations. The first
step's loss is the LLaVA's answer-only loss on the batch's images; frozen parts get no gradient and no
optimizer state and stay bit-identical; a resumed run equals an uninterrupted one; a LLaVA directory is
a starting point. On gloo ranks every layout of the language model equals one process (fp32, losses
and weights 1e-5): dp_shard, dp_replicate, tp (with dp_shard too), tp with sp, pp (the tower and
projector on the first stage only, which alone gets the images; with dp_shard, with tp and sp and tied
embeddings, interleaved, with a frozen language model), cp (both splits), ep of an MoE language model
(with dp_shard, with cp) and the distributed optimizer; a rank whose rows hold no image trains too; a
one-process checkpoint resumes under tp and under pp."""

import copy
import json

import numpy as np
import pytest
import torch

from tessera.checkpoint.hf.llava import save_llava
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.data.batching import BatchIterator
from tessera.models.vision.llava import Llava
from tessera.train.objectives.loss import IGNORE_INDEX, masked_targets
from tessera.train.trainer import Trainer
from tessera.train.vision_language import FROZEN_PARTS, unused_tower_modules, vision_model_config
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.parallel.trainer_runs import (
    assert_frozen_parts_untouched,
    assert_merged_weights_equal,
    merged_weights,
    whole_parameters,
)
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
    # the tower's last block and final norm are past feature_layer=-2: never run, so never trained
    unused = {id(p) for m in unused_tower_modules(trainer.model) for p in m.parameters()}
    assert len(unused) == len(list(trainer.model.vision_tower.layers["1"].parameters())) + 2
    assert_frozen_parts_untouched(trainer, before, lambda name, p: name.split(".")[0] in frozen or id(p) in unused)


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


def _train_on_ranks(run_overrides):
    trainer = Trainer(load_config(CONFIG, run_overrides))
    pipeline = getattr(trainer.engine, "run", None)
    stages = pipeline.stage_ids if pipeline is not None else [0]
    given_images = set()  # the stages whose forward was given pixel values
    for stage, part in zip(stages, trainer.parts, strict=True):
        part.register_forward_pre_hook(
            lambda m, args, kwargs, stage=stage: given_images.add(stage) if "pixel_values" in kwargs else None,
            with_kwargs=True)
    result = trainer.train()
    towers = {stage for stage, part in zip(stages, trainer.parts, strict=True) if part.vision_tower is not None}
    return {"losses": _losses(result), "weights": whole_parameters(trainer.parts), "stages": stages,
            "given_images": given_images, "towers": towers, "records": result.records}


def _world(layout):
    return int(np.prod([int(layout.get(f"parallel.{k}", 1)) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]))


def _assert_equal_to_one_process(tmp_path, layout, steps=3, **extra):
    """`layout` on gloo ranks against one process (both with `extra` and the layout's own non-parallel
    settings): losses, aux losses and every weight 1e-5, frozen parts bit-identical; returns the ranks'
    results."""
    settings = {"train.global_batch_size": 8, "train.micro_batch_size": 2, "checkpoint.interval": 0, **extra}
    model = {k: v for k, v in layout.items() if not k.startswith("parallel.")}
    one = _trainer(tmp_path / "one", steps, **settings, **model)
    result = one.train()
    want = {k: v.detach() for k, v in one.model.named_parameters()}
    got = run_ranks(_train_on_ranks, _world(layout), overrides(tmp_path / "ranks", steps, **settings, **layout),
                    timeout=HANG_S)
    assert got[0]["losses"] == pytest.approx(_losses(result), rel=1e-5, abs=1e-5)
    for r, w in zip(got[0]["records"], result.records, strict=True):
        if "aux_loss" in w:
            assert r["aux_loss"] == pytest.approx(w["aux_loss"], rel=1e-5, abs=1e-9)
    weights = merged_weights(got)
    assert set(weights) == set(want)
    frozen = [p for k, p in FROZEN_PARTS.items() if layout.get(f"train.vision_language.{k}") == "true"]
    for name, value in weights.items():
        if name.split(".")[0] in frozen:
            assert torch.equal(value, want[name]), name
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=name)
    return got


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"parallel.dp_shard": 2},
                                    {"parallel.dp_replicate": 2, "parallel.dp_shard": 1,
                                     "train.vision_language.freeze_vision_tower": "true"},
                                    {"parallel.tp": 2, "parallel.dp_shard": 1},
                                    {"parallel.tp": 2, "parallel.dp_shard": 2,
                                     "train.vision_language.freeze_language_model": "true"},
                                    {"parallel.tp": 2, "parallel.sp": "true", "parallel.dp_shard": 1},
                                    {"parallel.dp_shard": 2, "parallel.optimizer": "distributed"}],
                         ids=["dp_shard", "dp_replicate-frozen_tower", "tp", "tp-dp_shard-frozen_lm", "tp-sp",
                              "dp_shard-distributed_optimizer"])
def test_data_and_tensor_parallel_equal_one_process(tmp_path, layout):
    _assert_equal_to_one_process(tmp_path, layout)


PIPELINES = {
    "pp": {"parallel.pp": 2, "parallel.dp_shard": 1},
    "pp-dp_shard-frozen_tower": {"parallel.pp": 2, "parallel.dp_shard": 2,
                                 "train.vision_language.freeze_vision_tower": "true"},
    "pp-tp-sp-tied": {"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": "true", "parallel.dp_shard": 1,
                      "model.tie_embeddings": "true"},
    "pp-frozen_lm": {"parallel.pp": 2, "parallel.dp_shard": 1, "train.vision_language.freeze_language_model": "true"},
    "pp-dp_shard-distributed_optimizer-frozen_lm": {
        "parallel.pp": 2, "parallel.dp_shard": 2, "parallel.optimizer": "distributed",
        "train.vision_language.freeze_language_model": "true"},
    "pp-interleaved": {"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved_1f1b",
                       "parallel.dp_shard": 1, "model.n_layers": 4},
}


@pytest.mark.dist
@pytest.mark.parametrize("layout", PIPELINES.values(), ids=PIPELINES.keys())
def test_pipeline_parallel_equals_one_process_with_the_tower_on_the_first_stage(tmp_path, layout):
    got = _assert_equal_to_one_process(tmp_path, layout)
    for rank in got:  # the tower and projector live on stage 0; only its rank is given images
        first = 0 in rank["stages"]
        assert rank["towers"] == ({0} if first else set()), rank["stages"]
        # (torch hands every stage of a rank the same keyword arguments: under the interleaved
        # schedule stage 0's rank also gives them to its later stage, which has no tower to use them)
        assert (0 in rank["given_images"]) == first and (first or not rank["given_images"]), rank["stages"]
        image_side = {n for n in rank["weights"] if n.startswith(("vision_tower.", "projector."))}
        assert bool(image_side) == first


CONTEXTS = {"cp-contiguous": {"parallel.cp": 2, "parallel.dp_shard": 1},
            "cp-zigzag-tp-sp": {"parallel.cp": 2, "parallel.cp_method": "ring", "parallel.tp": 2,
                                "parallel.sp": "true", "parallel.dp_shard": 1}}


@pytest.mark.dist
@pytest.mark.parametrize("layout", CONTEXTS.values(), ids=CONTEXTS.keys())
def test_context_parallel_equals_one_process(tmp_path, layout):
    _assert_equal_to_one_process(tmp_path, layout)


# A Mixtral-style language model behind the tower: 4 experts, the Switch loss and the aux-loss-free bias
MOE = {"model.preset": "tiny-moe", "model.moe.num_experts": 4, "model.moe.ffn_dim": 32,
       "model.moe.aux_loss_coef": 0.01, "model.moe.expert_bias": "true", "model.moe.score_func": "sigmoid"}
EXPERTS = {"ep-dp_shard": {"parallel.ep": 2, "parallel.dp_shard": 2},
           "ep-cp": {"parallel.ep": 2, "parallel.cp": 2, "parallel.dp_shard": 1}}


@pytest.mark.dist
@pytest.mark.parametrize("layout", EXPERTS.values(), ids=EXPERTS.keys())
def test_expert_parallel_of_an_moe_language_model_equals_one_process(tmp_path, layout):
    got = _assert_equal_to_one_process(tmp_path, {**layout, **MOE})
    assert all("aux_loss" in r for r in got[0]["records"])
    experts = [v for k, v in merged_weights(got).items() if k.endswith("moe.experts.w1")]
    assert experts and experts[0].shape[0] == 4


def _text_heavy_data(directory):
    """The shapes with six of the eight conversations text-only, so that whole ranks' rows and
    pipeline micro-batches hold no image."""
    directory.mkdir()
    lines = (ROOT / "examples" / "data" / "shapes" / "shapes.jsonl").read_text().splitlines()
    for png in (ROOT / "examples" / "data" / "shapes").glob("*.png"):
        (directory / png.name).write_bytes(png.read_bytes())
    text = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]}
    records = lines[:2] + [json.dumps(text)] * 6
    (directory / "mixed.jsonl").write_text("".join(r + "\n" for r in records))
    return str(directory / "mixed.jsonl")


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"parallel.dp_shard": 2}, {"parallel.pp": 2, "parallel.dp_shard": 1}],
                         ids=["dp_shard", "pp"])
def test_ranks_and_micro_batches_without_images_equal_one_process(tmp_path, layout):
    # The image side takes part in every backward (zero gradients without images), so FSDP reduces
    # the same tensors on every rank; before, a rank without images left them out and the
    # reduce-scatter failed.
    data = _text_heavy_data(tmp_path / "data")
    _assert_equal_to_one_process(tmp_path, layout, steps=4, **{
        "data.datasets": f"[{{path: {data}}}]", "train.global_batch_size": 4, "optim.eps": 1e-3})


def _resume_on_ranks(run_overrides):
    trainer = Trainer(load_config(CONFIG, run_overrides), resume=True)
    start = trainer.step
    result = trainer.train()
    return {"start": start, "losses": _losses(result), "weights": whole_parameters(trainer.parts)}


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"parallel.tp": 2, "parallel.dp_shard": 1},
                                    {"parallel.pp": 2, "parallel.dp_shard": 1},
                                    {"parallel.pp": 2, "parallel.dp_shard": 1,
                                     "train.vision_language.freeze_language_model": "true"}],
                         ids=["tp", "pp", "pp-frozen_lm"])
def test_a_one_process_checkpoint_resumes_under_another_layout(tmp_path, layout):
    # (with a frozen language model the last stage has no optimizer state to read: its weights only)
    steps = {"train.global_batch_size": 8, "train.micro_batch_size": 2, "checkpoint.interval": 2,
             **{k: v for k, v in layout.items() if not k.startswith("parallel.")}}
    whole = _trainer(tmp_path / "whole", 4, **steps)
    want_losses = _losses(whole.train())
    _trainer(tmp_path / "cut", 2, **steps).train()
    layout = {k: v for k, v in layout.items() if k.startswith("parallel.")}
    results = run_ranks(_resume_on_ranks, 2, overrides(tmp_path / "cut", 4, **steps, **layout), timeout=HANG_S)
    got = results[0]
    assert got["start"] == 2
    assert got["losses"] == pytest.approx(want_losses[2:], rel=1e-5, abs=1e-5)
    assert_merged_weights_equal(results, {name: p.detach() for name, p in whole.model.named_parameters()})
