"""`tessera train` with data.kind=vision_sft on Qwen2-VL / Qwen2.5-VL: a batch of native-resolution images
of several sizes (each its own number of tokens between vision start / end), M-RoPE positions from the
grids. From a transformers Qwen2-VL / Qwen2.5-VL directory, step 1's loss is transformers' answer-only
cross-entropy on the batch images; the freeze switches (the tower, the patch merger, the language
model) keep their parts bit-identical with no optimizer state; the validation loss is the model's on
the held-out conversations (one process, dp_shard, pp, cp); a resumed run equals an uninterrupted
one; the export loads in transformers with equal logits, and served, a chat takes the training
sample's prompt tokens. On gloo ranks every layout of the language model equals one process (fp32,
losses and weights 1e-5): dp_shard, tp, tp with sp, cp (both splits, also with tp and sp), the
distributed optimizer, and pp (the tower on the first stage, every stage given its rows' M-RoPE
positions; also interleaved with cp); expert parallelism is refused by name (the qwen2 decoder is
dense)."""

import copy

import numpy as np
import pytest
import torch

from tessera.checkpoint.dcp.vision_language import save_vision_language_checkpoint
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.data.batching import BatchIterator
from tessera.data.qwen_image_processor import QwenImageProcessor
from tessera.models.vision.qwen_vl import QwenVL
from tessera.train.objectives.loss import IGNORE_INDEX, masked_targets
from tessera.train.trainer import Trainer
from tessera.train.vision_language import vision_model_config
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.models.qwen_vl_cases import hf_processor, hf_qwen_vl
from tests.parallel.trainer_runs import assert_frozen_parts_untouched, assert_merged_weights_equal, whole_parameters
from tests.train.runs import ROOT

CONFIG = str(ROOT / "configs" / "tiny-qwen2-vl.yaml")
SHAPES = ROOT / "examples" / "data" / "shapes"
DATA = f"[{{path: {SHAPES / 'shapes.jsonl'}}}, {{path: {SHAPES / 'sizes.jsonl'}}}]"
VOCAB = 4100  # the bundled tokenizer's 4096 ids, then video, vision start, vision end, image


def overrides(run_dir, steps, **extra):
    values = {"run_dir": str(run_dir), "train.steps": steps, "log.progress_bar": "false", "train.log_interval": 1,
              "checkpoint.export_hf": "false", "data.datasets": DATA, **extra}
    return [f"{k}={v}" for k, v in values.items()]


def _trainer(run_dir, steps, resume=False, **extra):
    return Trainer(load_config(CONFIG, overrides(run_dir, steps, **extra)), resume=resume)


def _losses(result):
    return [r["loss"] for r in result.records if "loss" in r]


def _hf_directory(version, path):
    """A random transformers Qwen2-VL / Qwen2.5-VL (vocabulary 4100) saved with its image processor."""
    hf = hf_qwen_vl(version, seed=2, vocab=VOCAB)
    hf.save_pretrained(path)
    hf_processor().save_pretrained(path)
    return hf


def _hf_answer_loss(hf, batch):
    targets = masked_targets(batch.targets, batch.target_mask)
    ids = batch.inputs
    with torch.no_grad():
        logits = hf(input_ids=ids, pixel_values=torch.cat(batch.pixel_values),
                    image_grid_thw=torch.cat(batch.image_grid_thw),
                    mm_token_type_ids=(ids == hf.config.image_token_id).int()).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                   ignore_index=IGNORE_INDEX))


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen2_5_vl"])
def test_the_first_step_is_transformers_answer_loss_on_the_batch_images(tmp_path, version):
    hf = _hf_directory(version, tmp_path / "hf")
    bare = overrides(tmp_path / "run", 1, **{"train.init_from": tmp_path / "hf"})
    trainer = Trainer(load_config(None, bare + [
        "data.kind=vision_sft", "train.seq_len=64", "train.device=cpu", "train.global_batch_size=12",
        "train.micro_batch_size=4", "data.valid_fraction=0", "log.tensorboard=false"]))
    model = trainer.model
    assert isinstance(model, QwenVL) and model.cfg.version == version and trainer.cfg.model.vocab_size == VOCAB
    theirs = {k: v for k, v in hf.state_dict().items()}
    assert len(dict(model.named_parameters())) == len(theirs)  # the whole model was read, tower included
    data = trainer.data.train
    batch = BatchIterator(data.dataset, data.global_batch_size, seed=data.seed).next_batch()
    grids = {tuple(g) for rows in batch.image_grid_thw for g in rows.tolist()}
    assert {(1, 4, 4), (1, 6, 10), (1, 4, 8), (1, 8, 4)} <= grids  # native resolution: four sizes in one batch
    want = _hf_answer_loss(hf, batch)
    [got] = _losses(trainer.train())
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    blank = copy.copy(batch)
    blank.pixel_values = [torch.zeros_like(p) for p in batch.pixel_values]
    assert abs(_hf_answer_loss(hf, blank) - want) > 1e-4  # the images reached the loss
    targets = masked_targets(batch.targets, batch.target_mask)
    assert int((targets != IGNORE_INDEX).sum()) < int((batch.inputs != 0).sum()) // 3  # answers only


def test_a_vision_language_checkpoint_is_the_starting_point_with_the_pixel_range_set_here(tmp_path):
    cfg = load_config(CONFIG, overrides(tmp_path / "unused", 1))
    model_cfg, _ = vision_model_config(cfg)
    source = QwenVL(model_cfg, init_seed=5)
    save_vision_language_checkpoint(source, tmp_path / "ckpt", QwenImageProcessor.for_vision(model_cfg.vision))
    trainer = _trainer(tmp_path / "run", 1, **{"train.init_from": tmp_path / "ckpt"})
    want = source.state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    # the checkpoint's processor, within the config's min_pixels / max_pixels: a 16x16 image takes 4 tokens
    _, processor = vision_model_config(trainer.cfg)
    assert (processor.min_pixels, processor.max_pixels) == (256, 1024)
    assert [len(s.grids) for s in trainer.data.train.dataset.samples][:2] == [1, 1]


def _part(name: str) -> str:
    """The freeze switch's part of a QwenVL parameter: the patch merger is the projector."""
    if name.startswith("vision_tower.merger."):
        return "projector"
    return name.split(".")[0]


@pytest.mark.parametrize("frozen", [("vision_tower",), ("projector", "language_model")])
def test_frozen_parts_stay_bit_identical_without_gradient_or_optimizer_state(tmp_path, frozen):
    switches = {f"train.vision_language.freeze_{p}": "true" for p in frozen}
    trainer = _trainer(tmp_path / "run", 3, **switches)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    parts = {_part(name) for name, _ in trainer.model.named_parameters()}
    assert parts == {"vision_tower", "projector", "language_model"}
    assert_frozen_parts_untouched(trainer, before, lambda name, p: _part(name) in frozen)


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    switch = {"train.vision_language.freeze_vision_tower": "true"}
    whole = _trainer(tmp_path / "whole", 4, **switch)
    whole_losses = _losses(whole.train())
    _trainer(tmp_path / "cut", 2, **switch, **{"checkpoint.interval": 2}).train()
    second = _trainer(tmp_path / "cut", 4, resume=True, **switch, **{"checkpoint.interval": 2})
    assert second.step == 2
    assert _losses(second.train()) == whole_losses[2:]
    want = whole.model.state_dict()
    for name, value in second.model.state_dict().items():
        assert torch.equal(value, want[name]), name


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_the_export_loads_in_transformers_with_equal_logits(tmp_path, family):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    trainer = _trainer(tmp_path / "run", 2, **{"checkpoint.export_hf": "true", "train.vision_language.family": family})
    result = trainer.train()
    hf = AutoModelForImageTextToText.from_pretrained(result.written, dtype=torch.float32).eval()
    assert type(hf).__name__ == {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[family]
    data = trainer.data.train
    batch = BatchIterator(data.dataset, 12, seed=data.seed).next_batch()
    from PIL import Image

    image = Image.open(SHAPES / "green_ellipse.png")
    theirs = AutoImageProcessor.from_pretrained(result.written)(image, return_tensors="np")
    _, processor = vision_model_config(trainer.cfg)
    pixels, grid = processor(image)
    assert np.array_equal(pixels, theirs["pixel_values"]) and list(grid) == theirs["image_grid_thw"][0].tolist()
    pixels, grids = torch.cat(batch.pixel_values), torch.cat(batch.image_grid_thw)
    with torch.no_grad():
        want = trainer.model.eval()(batch.inputs, pixel_values=pixels, image_grid_thw=grids).logits
        got = hf(input_ids=batch.inputs, pixel_values=pixels, image_grid_thw=grids,
                 mm_token_type_ids=(batch.inputs == hf.config.image_token_id).int()).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _greedy(model, ids: list[int], pixels: torch.Tensor, grids: torch.Tensor, steps: int) -> list[int]:
    """Greedy continuation of `ids`, the whole sequence run each step (its M-RoPE positions from the grids)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([out]), pixel_values=pixels, image_grid_thw=grids).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


def test_the_server_sees_the_training_samples_prompt(tmp_path):
    """The exported run served: a chat with two images of different sizes takes exactly the prompt tokens
    the training sample of the same conversation holds before its answer (vision start, each image's
    own placeholders, vision end, the text pieces), and the server's greedy answer is the trained
    model's on those tokens."""
    import base64

    import httpx

    from tessera.infer import EngineConfig, LLMEngine
    from tests.infer.running_server import RunningServer

    trainer = _trainer(tmp_path / "run", 2, **{"checkpoint.export_hf": "true"})
    result = trainer.train()
    sample = trainer.data.train.dataset.samples[10]  # sizes.jsonl's two-image conversation
    assert sample.grids.tolist() == [[1, 6, 10], [1, 4, 4]]
    prompt = sample.tokens[:int(np.argmax(sample.loss_mask))].tolist()  # through the assistant header
    pixels, grids = torch.from_numpy(sample.pixels), torch.from_numpy(sample.grids)
    want = _greedy(trainer.model.eval(), prompt, pixels, grids, 6)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        (SHAPES / name).read_bytes()).decode()}} for name in ("green_ellipse.png", "red_circle.png")]
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts + [
        {"type": "text", "text": "Which one is green?"}]}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with RunningServer(LLMEngine.from_dir(result.written, EngineConfig(block_size=4))) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    assert max(want) < 4096 and r.json()["choices"][0]["message"]["content"] == trainer.data.tokenizer.decode(want)


def _evaluate(run_overrides):
    return Trainer(load_config(CONFIG, run_overrides)).evaluate()["val_loss"]


@pytest.mark.dist
def test_validation_loss_is_the_models_on_the_held_out_conversations_with_their_images(tmp_path):
    # (init_std 0.3: attention far from uniform, so that positions change the loss)
    extra = {"data.valid_fraction": 0.25, "train.eval_interval": 1, "train.eval_steps": 1, "model.init_std": 0.3}
    trainer = _trainer(tmp_path / "run", 1, **extra)
    held_out = trainer.data.valid.samples
    assert [len(s.grids) for s in held_out] == [1, 2, 1]  # the last three of sizes.jsonl
    tokens = torch.from_numpy(np.stack([s.tokens for s in held_out]))
    mask = torch.from_numpy(np.stack([s.loss_mask for s in held_out]))
    targets = masked_targets(tokens[:, 1:], mask[:, 1:])
    with torch.no_grad():
        logits = trainer.model.eval()(tokens[:, :-1], pixel_values=torch.cat([torch.from_numpy(s.pixels)
                                                                             for s in held_out]),
                                      image_grid_thw=torch.cat([torch.from_numpy(s.grids) for s in held_out])).logits
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                   ignore_index=IGNORE_INDEX))
    assert trainer.evaluate()["val_loss"] == pytest.approx(want, rel=1e-6)
    # under dp_shard=2 the ranks split the rows (the short batch padded), under pp=2 the last stage
    # scores them with the M-RoPE positions it was handed, under zig-zag cp=2 each rank its chunks: the same loss
    for i, layout in enumerate([{"parallel.dp_shard": 2}, {"parallel.pp": 2, "parallel.dp_shard": 1},
                                {"parallel.cp": 2, "parallel.cp_method": "ring", "parallel.dp_shard": 1}]):
        got = run_ranks(_evaluate, 2, overrides(tmp_path / f"ranks{i}", 1, **extra, **layout), timeout=HANG_S)[0]
        assert got == pytest.approx(want, rel=1e-5), layout


def _train_on_ranks(run_overrides):
    trainer = Trainer(load_config(CONFIG, run_overrides))
    result = trainer.train()
    return {"losses": _losses(result), "weights": whole_parameters(trainer.parts)}


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"parallel.dp_shard": 2},
                                    {"parallel.tp": 2, "parallel.dp_shard": 1,
                                     "train.vision_language.family": "qwen2_5_vl",
                                     "train.vision_language.freeze_projector": "true"}])
def test_data_and_tensor_parallel_equal_one_process(tmp_path, layout):
    steps = {"train.global_batch_size": 8, "train.micro_batch_size": 2, "checkpoint.interval": 0}
    same = {k: v for k, v in layout.items() if k.startswith("train.")}
    one = _trainer(tmp_path / "one", 3, **steps, **same)
    want_losses = _losses(one.train())
    want = {k: v.detach() for k, v in one.model.named_parameters()}
    got = run_ranks(_train_on_ranks, 2, overrides(tmp_path / "ranks", 3, **steps, **layout), timeout=HANG_S)[0]
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-5)
    assert set(got["weights"]) == set(want)
    for name, value in got["weights"].items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.dist
@pytest.mark.parametrize("config, layout", [("tiny-qwen2-vl", {"parallel.dp_shard": 2}),
                                            ("tiny-llava", {"parallel.dp_shard": 2}),
                                            ("tiny-qwen2-vl", {"parallel.pp": 2, "parallel.dp_shard": 1})],
                         ids=["qwen-dp_shard", "llava-dp_shard", "qwen-pp"])
def test_a_rank_whose_rows_are_all_text_still_reduces_the_towers_gradients(tmp_path, config, layout, write_mixed):
    """Step 1's seeded order puts the two text-only conversations on rank 0 and the two with images on
    rank 1: rank 0's tower and projector take part with zero gradients (`image_side_in_graph`), so
    both ranks reduce the same parameters (before, gloo failed) and the run equals one process. Under
    pp the same rows make the first micro-batch all text: its padded images are none."""
    path = str(ROOT / "configs" / f"{config}.yaml")
    steps = {"train.global_batch_size": 4, "train.micro_batch_size": 2, "checkpoint.interval": 0,
             "data.datasets": f"[{{path: {write_mixed}}}]"}
    one = Trainer(load_config(path, overrides(tmp_path / "one", 2, **steps)))
    first = BatchIterator(one.data.train.dataset, 4, seed=one.data.train.seed).next_batch()
    assert [len(p) > 0 for p in first.pixel_values] == [False, False, True, True]  # rank 0: rows 0 and 1
    before = {k: v.clone() for k, v in one.model.state_dict().items()}
    want_losses = _losses(one.train())
    want = {k: v.detach() for k, v in one.model.named_parameters()}
    assert not torch.equal(want["vision_tower.layers.0.mlp.fc1.weight"], before["vision_tower.layers.0.mlp.fc1.weight"])
    results = run_ranks(_train_config_on_ranks, 2, path, overrides(tmp_path / "ranks", 2, **steps, **layout),
                        timeout=HANG_S)
    assert results[0]["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-5)
    assert_merged_weights_equal(results, want)


def _train_config_on_ranks(config, run_overrides):
    trainer = Trainer(load_config(config, run_overrides))
    return {"losses": _losses(trainer.train()), "weights": whole_parameters(trainer.parts)}


@pytest.fixture
def write_mixed(tmp_path):
    """Four conversations, the first and third text-only (seed 0's first order is 2, 0, 1, 3)."""
    import json
    import shutil

    for name in ("red_bar.png", "green_ellipse.png"):
        shutil.copy(SHAPES / name, tmp_path / name)

    def image(name, answer):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": name},
                                                          {"type": "text", "text": "What is this?"}]},
                             {"role": "assistant", "content": answer}]}

    def text(question, answer):
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}

    records = [text("Name a colour.", "Blue."), image("red_bar.png", "A red bar."), text("Name a shape.", "A circle."),
               image("green_ellipse.png", "A green ellipse.")]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _train_layout_on_ranks(run_overrides):
    """One rank of a layout: its losses and whole weights, and per stage the tower it holds and the
    keyword arguments its forward was given (images, positions)."""
    trainer = Trainer(load_config(CONFIG, run_overrides))
    pipeline = getattr(trainer.engine, "run", None)
    stages = pipeline.stage_ids if pipeline is not None else [0]
    given = {stage: set() for stage in stages}
    for stage, part in zip(stages, trainer.parts, strict=True):
        part.register_forward_pre_hook(lambda m, args, kwargs, stage=stage: given[stage].update(kwargs),
                                       with_kwargs=True)
    result = trainer.train()
    towers = {stage for stage, part in zip(stages, trainer.parts, strict=True) if part.vision_tower is not None}
    return {"losses": _losses(result), "weights": whole_parameters(trainer.parts), "stages": stages,
            "given": given, "towers": towers}


def _world(layout):
    return int(np.prod([int(layout.get(f"parallel.{k}", 1)) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]))


def _assert_layout_equals_one_process(tmp_path, layout):
    """`layout` on gloo ranks against one process (both with the layout's non-parallel settings), 3
    steps of 8 rows in micro-batches of 2: losses and every weight 1e-5; returns the ranks' results."""
    settings = {"train.global_batch_size": 8, "train.micro_batch_size": 2, "checkpoint.interval": 0}
    model = {k: v for k, v in layout.items() if not k.startswith("parallel.")}
    one = _trainer(tmp_path / "one", 3, **settings, **model)
    want_losses = _losses(one.train())
    want = {k: v.detach() for k, v in one.model.named_parameters()}
    got = run_ranks(_train_layout_on_ranks, _world(layout), overrides(tmp_path / "ranks", 3, **settings, **layout),
                    timeout=HANG_S)
    assert got[0]["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-5)
    assert_merged_weights_equal(got, want)
    return got


# Each sequence of 64 tokens holds images of 4 to 15 placeholders, which the cp chunks (32 tokens, or
# zig-zag 16 + 16) and sp slices cut through: their M-RoPE positions come from the whole rows.
SEQUENCES = {
    "tp-sp": {"parallel.tp": 2, "parallel.sp": "true", "parallel.dp_shard": 1},
    "cp-contiguous": {"parallel.cp": 2, "parallel.dp_shard": 1},
    "cp-zigzag-qwen2_5_vl": {"parallel.cp": 2, "parallel.cp_method": "ring", "parallel.dp_shard": 1,
                             "train.vision_language.family": "qwen2_5_vl"},
    "cp-zigzag-tp-sp": {"parallel.cp": 2, "parallel.cp_method": "allgather", "parallel.tp": 2, "parallel.sp": "true",
                        "parallel.dp_shard": 1},
    "dp_shard-distributed_optimizer": {"parallel.dp_shard": 2, "parallel.optimizer": "distributed"},
}


@pytest.mark.dist
@pytest.mark.parametrize("layout", SEQUENCES.values(), ids=SEQUENCES.keys())
def test_sequence_and_context_parallel_and_the_distributed_optimizer_equal_one_process(tmp_path, layout):
    _assert_layout_equals_one_process(tmp_path, layout)


PIPELINES = {
    "pp": {"parallel.pp": 2, "parallel.dp_shard": 1},
    "pp-interleaved-cp-zigzag": {"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved_1f1b",
                                 "parallel.cp": 2, "parallel.cp_method": "allgather", "parallel.dp_shard": 1,
                                 "model.n_layers": 4},
}


@pytest.mark.dist
@pytest.mark.parametrize("layout", PIPELINES.values(), ids=PIPELINES.keys())
def test_pipeline_parallel_equals_one_process_with_the_positions_on_every_stage(tmp_path, layout):
    got = _assert_layout_equals_one_process(tmp_path, layout)
    for rank in got:
        first = 0 in rank["stages"]
        assert rank["towers"] == ({0} if first else set()), rank["stages"]
        for stage, kwargs in rank["given"].items():
            # every stage rotates by its rows' M-RoPE positions; only stage 0's rank is given images
            # (an interleaved schedule hands a rank's later stage its first stage's arguments too)
            assert "row_positions" in kwargs, stage
            assert ("pixel_values" in kwargs) == first, stage


def test_expert_parallel_is_refused_by_name_for_the_dense_qwen2_decoder(tmp_path):
    with pytest.raises(ConfigError, match="parallel.ep=2 is invalid: 1 with data.kind=vision_sft on Qwen2-VL / "
                                          "Qwen2.5-VL: their language model is a dense qwen2 decoder"):
        load_config(CONFIG, overrides(tmp_path, 1) + ["parallel.ep=2"])


@pytest.mark.parametrize("settings, problem", [
    (["train.vision_language.family=qwen3_vl"], "train.vision_language.family='qwen3_vl' is invalid: one of llava, "
                                                 "qwen2_vl, qwen2_5_vl"),
    (["model.family=llama", "model.qkv_bias=false"], "train.vision_language: qwen2_vl: the language model is a qwen2 "
                                                     "decoder; got family 'llama'"),
    (["train.vision_language.mrope_section=[2,2,2]"], r"mrope_section=\[2, 2, 2\] is invalid"),
    (["train.vision_language.vision_start_token_id=4099"], r"image_token_id=4099 is invalid \(the same id as "
                                                            r"vision_start_token_id\): the image, vision start / end"),
    (["model.vocab_size=3"], r"the video token \(vocab_size - 4\)=-1 is invalid \(outside the vocabulary\)"),
    (["train.vision_language.family=llava"], "min_pixels / max_pixels apply to Qwen2-VL / Qwen2.5-VL models"),
])
def test_bad_qwen_settings_are_refused_by_name(tmp_path, settings, problem):
    with pytest.raises(ConfigError, match=problem):
        vision_model_config(load_config(CONFIG, overrides(tmp_path, 1) + settings))


def test_a_qwen_source_in_init_from_is_refused_expert_parallelism_by_name_too(tmp_path):
    # the family comes from the directory, not train.vision_language.family (llava by default)
    _hf_directory("qwen2_vl", tmp_path / "hf")
    cfg = load_config(None, overrides(tmp_path / "run", 1, **{"train.init_from": tmp_path / "hf"}) + [
        "data.kind=vision_sft", "train.device=cpu", "parallel.ep=2"])
    assert cfg.train.vision_language.family == "llava"
    with pytest.raises(ConfigError, match="parallel.ep=2 is invalid: 1 with data.kind=vision_sft on Qwen2-VL"):
        vision_model_config(cfg)
