"""Distillation (train.distill) under layouts trains like one process: the teacher, a larger model
trained first, is built and cut by the student's layout (FSDP shards, replicas, tensor-parallel
slices whose vocabulary-sharded logits the KD term gathers, sequence parallelism, experts over
ranks, sequence chunks), and the logged data loss, distill_loss, gradient norms and final weights
equal the one-process run's, fp32 within 1e-5."""

from __future__ import annotations

import pytest

from tessera.config.errors import ParallelError
from tessera.config.schema import load_config
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import (
    MODELS,
    assert_same_training,
    overrides_for,
    train_on_ranks,
    train_one_process,
)

STEPS = 3
BIGGER = {"model.dim": 96, "model.ffn_dim": 192, "model.n_layers": 3}
DISTILL = {"train.distill.temperature": 2.0, "train.distill.weight": 0.5}
PP = {"parallel.pp": 2, "parallel.dp_shard": 1}
HIDDEN = {"train.distill.hidden_layers": [[0, 1], [1, 2]], "train.distill.hidden_weight": 0.3}
EVAL = {"train.eval_interval": STEPS, "data.valid_fraction": 0.2, "train.eval_steps": 2}


@pytest.fixture(scope="module")
def teachers(small_dataset, tmp_path_factory) -> dict[str, str]:
    """A dense and an MoE teacher, each a Tessera run directory trained 2 steps in one process."""
    out = {}
    for model in ("dense", "moe"):
        run = tmp_path_factory.mktemp(f"teacher-{model}")
        config, shrink_fn = MODELS[model]
        Trainer(load_config(config, shrink_fn(small_dataset, run, 2, **BIGGER))).train()
        out[model] = str(run)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", [
    pytest.param("dense", 2, {"parallel.dp_shard": 2}, id="dense-fsdp2"),
    pytest.param("dense", 2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, id="dense-replicate2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="dense-tp2"),
    pytest.param("moe", 2, {"parallel.ep": 2, "parallel.dp_shard": 2}, id="moe-ep2-fsdp2", marks=pytest.mark.slow),
    pytest.param("dense", 2, {"parallel.cp": 2, "parallel.dp_shard": 1}, id="dense-cp2", marks=pytest.mark.slow),
    pytest.param("moe", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, id="moe-tp2-sp",
                 marks=pytest.mark.slow),
    pytest.param("dense", 4, {"parallel.tp": 2, "parallel.dp_shard": 2}, id="dense-tp2-fsdp2",
                 marks=pytest.mark.slow),
    # Pipelines: the teacher's 3 layers are cut over the stages as the student's 2 are, its
    # activations travelling beside the student's; with evaluation (the teacher rides along, unused).
    pytest.param("dense", 2, {**PP, "parallel.pp_schedule": "1f1b", **EVAL}, id="dense-pp2-1f1b"),
    pytest.param("moe", 2, {**PP, "parallel.pp_schedule": "zero_bubble"}, id="moe-pp2-zero-bubble",
                 marks=pytest.mark.slow),
    pytest.param("dense", 4, {"parallel.pp": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 1, **EVAL},
                 id="dense-pp2-fsdp2"),
    pytest.param("dense", 4, {**PP, "parallel.tp": 2}, id="dense-pp2-tp2",
                 marks=pytest.mark.slow),
    # Hidden-state matching: the projections replicated, their gradients summed over the ranks.
    pytest.param("dense", 2, {"parallel.dp_shard": 2, **HIDDEN}, id="dense-fsdp2-hidden"),
    pytest.param("dense", 2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1, **HIDDEN},
                 id="dense-replicate2-hidden", marks=pytest.mark.slow),
])
def test_distillation_under_a_layout_trains_like_one_process(model, world, parallel, teachers, small_dataset,
                                                             tmp_path):
    distill = {**DISTILL, "train.distill.teacher": teachers[model]}
    shape = {k: v for k, v in parallel.items() if not k.startswith("parallel.")}
    ref = train_one_process(model, overrides_for(model, small_dataset, tmp_path / "one", STEPS, **distill, **shape))
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, small_dataset, tmp_path / "ranks", STEPS, **distill, **parallel))
    assert_same_training(got, ref, rtol=1e-5)
    for r, w in zip(got[0]["records"], ref["records"], strict=True):
        assert w["distill_loss"] > 0
        assert abs(r["distill_loss"] - w["distill_loss"]) <= 1e-5 * w["distill_loss"], (r, w)
        if "distill_hidden_loss" in w:
            assert r["distill_hidden_loss"] == pytest.approx(w["distill_hidden_loss"], rel=1e-5)
        if "val_loss" in w:  # evaluation measures the student alone
            assert abs(r["val_loss"] - w["val_loss"]) <= 1e-5 * w["val_loss"], (r, w)


def _refusal_on_ranks(overrides: list[str]) -> str:
    try:
        Trainer(load_config(MODELS["dense"][0], overrides))
    except ParallelError as e:
        return str(e)
    return "not refused"


@pytest.mark.dist
def test_a_teacher_with_fewer_layers_than_the_pipeline_stages_is_refused_by_name(teachers, small_dataset, tmp_path):
    """4 stages (pp 2 x vpp 2) for the student's 4 layers, but the teacher has 3: refused, naming it."""
    overrides = overrides_for("dense", small_dataset, tmp_path / "run", 1, **PP, **{
        "parallel.pp_schedule": "interleaved_1f1b", "parallel.vpp": 2, "model.n_layers": 4,
        "train.distill.teacher": teachers["dense"]})
    errors = run_ranks(_refusal_on_ranks, 2, overrides)
    assert errors[0] == errors[1]
    assert errors[0].startswith("train.distill.teacher (3 layers) cannot be cut by the student's pipeline: "
                                "4 pipeline stages cannot split model.n_layers=3"), errors[0]
