"""Knowledge distillation (train.distill) in one process: the logged KD term equals a hand
computation with torch's own kl_div on the student's and teacher's logits (SFT: answers only),
weight 0 trains exactly as the plain run, the teacher is frozen in the compute dtype, and a
teacher of another vocabulary or tokenizer is refused with exit 2 and one line."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from tessera.checkpoint.loading import load_model
from tessera.cli import main
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.train.data_source import build_training_data
from tessera.train.objectives.loss import masked_targets
from tessera.train.run.console import startup_summary
from tessera.train.run.rng_state import seed_everything
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, set_args, shrink

TEACHER = {"model.dim": 96, "model.ffn_dim": 192, "model.n_layers": 3, "checkpoint.export_hf": True}


@pytest.fixture(scope="module")
def teacher(small_dataset, tmp_path_factory):
    """A larger model trained a few steps on the same data and tokenizer: its run directory (a Tessera
    checkpoint) holds hf/, its HuggingFace export with the tokenizer files."""
    run = tmp_path_factory.mktemp("teacher")
    Trainer(load_config(TINY_DENSE, shrink(small_dataset, run, 3, **TEACHER))).train()
    return run


def _sft_dataset(directory) -> str:
    from tessera.data import default_tokenizer, preprocess_sft

    records = [{"prompt": f"What is {i} times {i + 3}?", "response": f"It is {i * (i + 3)}, I think."}
               for i in range(80)]
    (directory / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess_sft([directory / "chat.jsonl"], directory / "sft", default_tokenizer(), show_progress=False)
    return str(directory / "sft")


def test_kd_loss_of_a_step_equals_kl_div_over_the_answer_tokens(teacher, tmp_path):
    """Step 1's distill_loss = T^2 sum over answer tokens of KL(teacher || student) / loss tokens, by
    F.kl_div on log_softmax(logits / T) of the initial student and the teacher; loss is the data CE."""
    T = 2.0
    overrides = shrink(_sft_dataset(tmp_path), tmp_path / "run", 1, **{
        "data.kind": "sft", "train.distill.teacher": teacher / "hf", "train.distill.temperature": T,
        "train.distill.weight": 0.3})
    cfg = load_config(TINY_DENSE, overrides)
    record = Trainer(cfg).train().records[0]

    seed_everything(cfg.train.seed)
    batch = build_training_data(cfg).train.next_batch()
    student = Transformer(cfg.model, init_seed=cfg.train.seed)  # the weights step 1 starts from
    teacher_model = load_model(teacher / "hf").model
    keep = batch.target_mask.bool()
    assert 0 < int(keep.sum()) < keep.numel()  # answers only: prompts are masked out
    with torch.no_grad():
        s, t = student(batch.inputs).logits[keep], teacher_model(batch.inputs).logits[keep]
        kl = F.kl_div(F.log_softmax(s / T, dim=-1), F.log_softmax(t / T, dim=-1), log_target=True, reduction="sum")
        ce = F.cross_entropy(student(batch.inputs).logits.reshape(-1, s.shape[-1]),
                             masked_targets(batch.targets, batch.target_mask).reshape(-1), reduction="sum")
    n = int(keep.sum())
    assert record["loss_tokens"] == n
    assert record["distill_loss"] == pytest.approx(float(kl) * T * T / n, rel=1e-5)
    assert record["loss"] == pytest.approx(float(ce) / n, rel=1e-5)
    assert record["distill_loss"] > 0


def test_weight_zero_trains_exactly_as_the_plain_run(small_dataset, teacher, tmp_path):
    plain = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "plain", 3)))
    plain_records = plain.train().records
    zero = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "zero", 3, **{
        "train.distill.teacher": teacher, "train.distill.weight": 0.0})))
    zero_records = zero.train().records
    for p, z in zip(plain_records, zero_records, strict=True):
        assert (z["loss"], z["grad_norm"]) == (p["loss"], p["grad_norm"])
        assert "distill_loss" not in p and z["distill_loss"] > 0  # the teacher ran, its term weighed nothing
    for name, value in plain.model.state_dict().items():
        assert torch.equal(zero.model.state_dict()[name], value), name
    # A weight above 0 changes the training (the teacher's term reaches the gradient).
    half = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "half", 3, **{
        "train.distill.teacher": teacher, "train.distill.weight": 0.5}))).train().records
    assert half[0]["loss"] == plain_records[0]["loss"] and half[0]["grad_norm"] != plain_records[0]["grad_norm"]


def test_teacher_is_frozen_in_the_compute_dtype_with_no_optimizer_state(small_dataset, teacher, tmp_path):
    cfg = load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "run", 2, **{
        "train.distill.teacher": teacher, "train.dtype": "bf16", "train.distill.weight": 0.25}))
    assert (f"distillation: teacher {teacher}, temperature 1, weight 0.25 (objective 0.75 x loss + 0.25 x "
            "distill_loss)") in startup_summary(cfg, 1, "cpu", 2, 0)
    trainer = Trainer(cfg)
    records = trainer.train().records
    model = trainer.engine.distiller.teacher
    assert not model.training and all(math.isfinite(r["distill_loss"]) for r in records)
    params = dict(model.named_parameters())
    assert not any(p.requires_grad or p.grad is not None for p in params.values())
    assert params["layers.0.attention.wq.weight"].dtype == torch.bfloat16  # matrices in the compute dtype
    assert params["norm.weight"].dtype == torch.float32  # as autocast leaves them
    optimized = {id(p) for o in trainer.optimizers for g in o.param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in params.values()}
    assert len(params) == len(dict(load_model(teacher).model.named_parameters()))  # the teacher's own shape


def _refusal(capsys, run, teacher_dir, small_dataset) -> str:
    status = main(["train", TINY_DENSE, *set_args(shrink(small_dataset, run, 1, **{
        "train.distill.teacher": teacher_dir}))])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("tessera train: error: train.distill.teacher=")
    assert not (run / "metrics.jsonl").exists()
    return err


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_refused(small_dataset, teacher, tmp_path, capsys):
    bigger = tmp_path / "bigger"
    shutil.copytree(teacher / "hf", bigger)
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "vocab_size": 5000}))
    err = _refusal(capsys, tmp_path / "a", bigger, small_dataset)
    assert "its vocabulary has 5000 tokens, the student's (model.vocab_size) 4096" in err

    other = tmp_path / "other"  # the same size, two tokens' ids swapped: another tokenizer
    shutil.copytree(teacher / "hf", other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    err = _refusal(capsys, tmp_path / "b", other, small_dataset)
    assert "its tokenizer" in err and "is not the student's (data.tokenizer=default): 4 token -> id entries" in err

    err = _refusal(capsys, tmp_path / "c", tmp_path / "missing", small_dataset)
    assert "no such directory" in err


@pytest.mark.parametrize("key,value,allowed", [
    ("train.distill.temperature", 0, "must be in (0, 10000]"),
    ("train.distill.weight", 1.5, "must be in [0, 1]"),
    ("train.distill.teacher", '""', "a HuggingFace model directory or a Tessera checkpoint"),
    ("train.loss_chunk_tokens", 16, "0 or null with train.distill.teacher"),
    ("train.distill.teachr", "x", "did you mean train.distill.teacher?"),
])
def test_distill_keys_are_checked(key, value, allowed, tmp_path):
    overrides = [f"run_dir={tmp_path}", "train.distill.teacher=/some/teacher", f"{key}={value}"]
    with pytest.raises(ConfigError) as e:
        load_config(TINY_DENSE, overrides)
    assert key in str(e.value) and allowed in str(e.value)
