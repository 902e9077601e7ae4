"""The builder hands every step engine its parts finished: materialised (parallelized, cut into
stages) modules, the optimizers over exactly their parameters, the loss scaler; the engine of the
layout takes them as they are."""

from __future__ import annotations

import pytest
import torch

from tessera.config.schema import load_config
from tessera.parallel.distributed_optimizer import DistributedOptimizer
from tessera.train.builder import build_step_engine, build_training_parts
from tessera.train.run.layout import build_layout
from tessera.train.steps.loss_scaler import DynamicLossScaler
from tessera.train.steps.parallel_step import ParallelStep
from tessera.train.steps.pipeline_step import PipelineStep
from tessera.train.steps.single_process_step import SingleProcessStep
from tests.hang_guard import HANG_S
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink


def _optimized(optimizer) -> set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def test_one_process_engine_gets_the_built_model_optimizer_and_scaler(tmp_path):
    cfg = load_config(TINY_DENSE, shrink("unused", tmp_path, 1, **{"train.dtype": "fp16"}))
    layout = build_layout(cfg)
    built = build_training_parts(cfg, layout, None, compile=False)
    engine = build_step_engine(cfg, layout, built)
    assert isinstance(engine, SingleProcessStep) and engine.parts == built.parts and built.pipeline is None
    assert isinstance(built.loss_scaler, DynamicLossScaler) and engine.loss_scaler is built.loss_scaler
    (model,), (optimizer,) = built.parts, built.optimizers
    assert _optimized(optimizer) == {id(p) for p in model.parameters()}
    assert not any(p.is_meta for p in model.parameters())
    assert built.full_shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert not built.distributed_optimizers and built.autocast_dtype == torch.float16


def _build_on_rank(overrides: list[str]) -> dict:
    cfg = load_config(TINY_MOE, overrides)
    layout = build_layout(cfg)
    built = build_training_parts(cfg, layout, None, compile=False)
    engine = build_step_engine(cfg, layout, built)
    params = [p for m in built.parts for p in m.parameters()]
    return {
        "engine": type(engine).__name__,
        "same_parts": engine.parts == built.parts,
        "engine_optimizers": engine.distributed_optimizers == built.optimizers,
        "distributed": all(isinstance(o, DistributedOptimizer) for o in built.optimizers),
        "one_per_part": len(built.optimizers) == len(built.parts),
        "materialised": not any(p.is_meta for p in params),
        "schedule_runs_parts": built.pipeline is not None and list(built.pipeline.run.modules) == built.parts,
        "loss_scaled": built.pipeline is not None and built.pipeline.loss.loss_scaler is built.loss_scaler,
        "full_shapes": set(built.full_shapes),
        "part_keys": {k for m in built.parts for k in m.state_dict()},
    }


@pytest.mark.dist
@pytest.mark.parametrize("parallel,engine", [
    ({"parallel.pp": 2, "parallel.dp_shard": 1, "train.micro_batch_size": 1}, PipelineStep),
    ({"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, ParallelStep),
], ids=["pp2", "dp2"])
def test_engine_on_ranks_gets_the_built_parts_and_distributed_optimizers(small_dataset, tmp_path, parallel, engine):
    from tests.forked_ranks import run_ranks

    overrides = moe_shrink(small_dataset, tmp_path, 1, **{"parallel.optimizer": "distributed", "train.dtype": "bf16",
                                                          **parallel})
    ranks = run_ranks(_build_on_rank, 2, overrides, timeout=HANG_S)
    assert ranks[0]["full_shapes"] == ranks[1]["full_shapes"]  # the whole model's, on every rank
    for rank in ranks:
        assert rank["engine"] == engine.__name__
        assert rank["same_parts"] and rank["engine_optimizers"] and rank["distributed"] and rank["one_per_part"]
        assert rank["materialised"]
        assert rank["schedule_runs_parts"] == (engine is PipelineStep)
        assert rank["loss_scaled"] == (engine is PipelineStep)  # bf16: no scaler, and the loss holds None
        assert rank["part_keys"] < rank["full_shapes"] if engine is PipelineStep else \
            rank["part_keys"] == rank["full_shapes"]  # a stage holds part of the model
