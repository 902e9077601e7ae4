"""`parallel.ep_dispatcher` chooses how MoE tokens reach experts on other ranks: the key is checked
where it is declared, and the Trainer's engines (pp = 1 and pipeline) install the dispatcher it
names, which trains like one process."""

from __future__ import annotations

import pytest

from tessera.config.errors import ConfigError
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import load_config
from tessera.models.moe import MoE
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import MODELS, assert_same_training, overrides_for, train_one_process, whole_parameters

STEPS = 3


def test_unknown_dispatcher_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"parallel.ep_dispatcher='ring' is invalid: one of alltoall, allgather"):
        ParallelConfig(ep_dispatcher="ring")
    assert ParallelConfig().ep_dispatcher == "alltoall"


def _train_and_name_dispatchers(overrides: list[str]) -> dict:
    """Runs on every rank: train the MoE model; records, whole weights and the dispatchers in use."""
    trainer = Trainer(load_config(MODELS["moe"][0], overrides))
    result = trainer.train()
    kinds = {type(m.dispatcher).__name__ for part in trainer.parts for m in part.modules() if isinstance(m, MoE)}
    return {"records": result.records, "weights": whole_parameters(trainer.parts), "dispatchers": kinds}


@pytest.mark.dist
@pytest.mark.parametrize("world,parallel", [
    pytest.param(2, {"parallel.ep": 2, "parallel.dp_shard": 2}, id="ep2-fsdp2"),
    pytest.param(4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 1},
                 id="pp2-ep2-fsdp2", marks=pytest.mark.slow),
])
def test_allgather_dispatcher_trains_like_one_process(world, parallel, small_dataset, tmp_path):
    shape = {k: v for k, v in parallel.items() if k.startswith("train.")}
    ref = train_one_process("moe", overrides_for("moe", small_dataset, tmp_path / "one", STEPS, **shape))
    got = run_ranks(_train_and_name_dispatchers, world, overrides_for(
        "moe", small_dataset, tmp_path / "ranks", STEPS, **parallel, **{"parallel.ep_dispatcher": "allgather"}))
    assert all(r["dispatchers"] == {"AllGatherDispatcher"} for r in got)
    assert [r["step"] for r in got[0]["records"]] == [1, 2, 3]
    assert_same_training(got, ref, rtol=1e-5)
