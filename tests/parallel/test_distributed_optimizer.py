"""`parallel.optimizer=distributed` (tessera/parallel/distributed_optimizer.py) through the real
Trainer on forked gloo ranks: the same training as one process, the collectives the bucket sizes
imply, reduce-scatters issued while backward is still running, and a resume of its sharded state."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import load_config
from tessera.parallel.testing import RankFailure, run_ranks
from tessera.train.trainer import Trainer
from tests.parallel.trainer_runs import (MODELS, assert_same_training, overrides_for, train_on_ranks,
                                         train_one_process, whole_parameters)

STEPS = 3
# 0.1 MiB buckets cut the shrunken tiny models into several (embedding and head alone, blocks in
# pieces), so the bucket boundaries, padding and ordering are all exercised.
DISTRIBUTED = {"parallel.optimizer": "distributed", "parallel.bucket_mb": 0.1}
REPLICATE2 = {**DISTRIBUTED, "parallel.dp_replicate": 2, "parallel.dp_shard": 1}
EVAL = {"train.eval_interval": STEPS, "data.valid_fraction": 0.2, "train.eval_steps": 3}


@pytest.mark.dist
@pytest.mark.parametrize("model,world,layout", [
    pytest.param("dense", 2, REPLICATE2, id="dense-replicate2"),
    pytest.param("moe", 2, REPLICATE2, id="moe-replicate2"),
    pytest.param("dense", 4, {**REPLICATE2, "parallel.tp": 2}, id="dense-replicate2-tp2", marks=pytest.mark.slow),
    pytest.param("moe", 4, {**REPLICATE2, "parallel.tp": 2}, id="moe-replicate2-tp2", marks=pytest.mark.slow),
])
def test_distributed_optimizer_trains_as_one_process(model, world, layout, small_dataset, tmp_path):
    # micro-batch 1: two micro-batches per rank and step, so gradients accumulate before the reduction
    extra = {**EVAL, "train.micro_batch_size": 1}
    ref = train_one_process(model, overrides_for(model, small_dataset, tmp_path / "one", STEPS, **extra))
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, small_dataset, tmp_path / "dist", STEPS, **extra, **layout), timeout=120)
    assert_same_training(got, ref, rtol=1e-5)
