"""Distillation (train.distill) under layouts trains like one process: the teacher, a larger model
trained first, is built and cut by the student's layout (FSDP shards, replicas, tensor-parallel
slices whose vocabulary-sharded logits the KD term gathers, sequence parallelism, experts over
ranks, sequence chunks), and the logged data loss, distill_loss, gradient norms and final weights
equal the one-process run's, fp32 within 1e-5."""

from __future__ import annotations

import pytest

from tessera.config.schema import load_config
from tessera.parallel.testing import run_ranks
from tessera.train.trainer import Trainer
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
])
def test_distillation_under_a_layout_trains_like_one_process(model, world, parallel, teachers, small_dataset,
                                                             tmp_path):
    distill = {**DISTILL, "train.distill.teacher": teachers[model]}
    ref = train_one_process(model, overrides_for(model, small_dataset, tmp_path / "one", STEPS, **distill))
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, small_dataset, tmp_path / "ranks", STEPS, **distill, **parallel))
    assert_same_training(got, ref, rtol=1e-5)
    for r, w in zip(got[0]["records"], ref["records"], strict=True):
        assert w["distill_loss"] > 0
        assert abs(r["distill_loss"] - w["distill_loss"]) <= 1e-5 * w["distill_loss"], (r, w)
