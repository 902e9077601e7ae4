"""DualPipeV's overlapped pairs (tessera/parallel/pipeline_overlap.py): with pp2 x ep2 on four gloo ranks,
the real Trainer on a tiny MoE model, each paired forward and backward run at once (the forward's
expert all-to-alls on a twin communicator), logs the losses, aux losses, gradient norms and ends with
the weights of the same schedule run pair after pair, of 1F1B and of one process, in fp32 within 1e-5;
the pairs really ran overlapped (counted); in one pipeline step alone, every all-to-all of the worker
thread goes over the twin group and none of the caller's does, with the gradients of the pairs in turn;
the twin groups hold the same ranks as the groups they stand for and carry their own collectives."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tessera.config import get_preset
from tessera.config.errors import ConfigError
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.parallel import ParallelDims, parallelize, shard_global_batch
from tessera.parallel.pipeline import build_pipeline
from tessera.parallel.pipeline_overlap import overlaps, twin_groups
from tessera.train.objectives.loss import token_loss_sum
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import (
    MODELS,
    assert_same_training,
    merged_weights,
    overrides_for,
    train_one_process,
    whole_parameters,
)
from tests.parallel.training_step import SEED, global_batch

STEPS = 2
# pp2 x ep2 (ep folded over dp_shard = 2) under the distributed optimizer, DeepSeek-V3's recipe's: FSDP
# is not used here because torch's split input / weight backward (DualPipeV's warm-up) does not reach
# FSDP2's unsharded parameters, which this change does not touch. Four micro-batches of one row on each
# of the two data-parallel ranks: DualPipeV's 2 pp.
LAYOUT = {"model.n_layers": 4, "train.micro_batch_size": 1, "train.global_batch_size": 8,
          "parallel.pp": 2, "parallel.ep": 2, "parallel.dp_shard": 2, "parallel.optimizer": "distributed",
          "parallel.bucket_mb": 0.1}


def _train(overrides: list[str]) -> dict:
    trainer = Trainer(load_config(MODELS["moe"][0], overrides))
    result = trainer.train()
    pairs = getattr(trainer.engine.run, "overlapped", None)
    return {"records": result.records, "weights": whole_parameters(trainer.parts),
            "pairs": pairs.pairs if pairs is not None else 0}


@pytest.mark.dist
@pytest.mark.slow
def test_overlapped_dualpipev_trains_like_pairs_in_turn_1f1b_and_one_process(small_dataset, tmp_path):
    def run(name: str, **parallel) -> list[dict]:
        return run_ranks(_train, 4, overrides_for("moe", small_dataset, tmp_path / name, STEPS, **LAYOUT, **parallel))

    overlapped = run("overlapped", **{"parallel.pp_schedule": "dualpipev"})
    assert all(r["pairs"] > 0 for r in overlapped), [r["pairs"] for r in overlapped]
    in_turn = run("in-turn", **{"parallel.pp_schedule": "dualpipev", "parallel.pp_overlap": False})
    assert all(r["pairs"] == 0 for r in in_turn)
    assert_same_training(overlapped, in_turn[0] | {"weights": merged_weights(in_turn)}, rtol=1e-5)
    one_f_one_b = run("1f1b", **{"parallel.pp_schedule": "1f1b"})
    assert_same_training(overlapped, one_f_one_b[0] | {"weights": merged_weights(one_f_one_b)}, rtol=1e-5)
    shape = {k: v for k, v in LAYOUT.items() if k.startswith(("model.", "train."))}
    one = train_one_process("moe", overrides_for("moe", small_dataset, tmp_path / "one", STEPS, **shape))
    assert_same_training(overlapped, one, rtol=1e-5)


def _traced_step(overlap: bool) -> dict:
    """One step of the pipeline alone (no FSDP: the distributed optimizer's layout, each rank's
    gradients its own), every all-to-all traced with its thread and whether its group is a twin."""
    pcfg = ParallelConfig(pp=2, dp_shard=2, ep=2, pp_schedule="dualpipev", optimizer="distributed", pp_overlap=overlap)
    cfg = get_preset("tiny-moe", n_layers=4)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    batch = global_batch(cfg.vocab_size, rows=8)
    n_tokens = batch[:, 1:].numel()
    run = build_pipeline(Transformer(cfg, init_seed=SEED), dims, pcfg, 4,
                         loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / n_tokens,
                         aux_scale=1.0 / 8, parallelize_stage=lambda m: parallelize(m, dims, pcfg))
    twins = set(run.overlapped.twins.values()) if run.overlapped is not None else set()
    calls, real = [], dist.all_to_all_single

    def traced(*args, group=None, **kwargs):  # counts what the real collective does, then runs it
        calls.append((threading.current_thread() is threading.main_thread(), group in twins))
        return real(*args, group=group, **kwargs)

    dist.all_to_all_single = traced
    try:
        rows = shard_global_batch(batch, dims)
        losses = run.step(rows[:, :-1], rows[:, 1:])
    finally:
        dist.all_to_all_single = real
    return {"losses": [float(x.detach()) for x in losses], "calls": calls,
            "grads": {n: p.grad.detach().clone() for n, p in run.named_parameters()}}


@pytest.mark.dist
def test_the_pairs_forward_exchanges_on_the_twin_group_and_gives_the_same_gradients():
    overlapped = run_ranks(_traced_step, 4, True)
    in_turn = run_ranks(_traced_step, 4, False)
    for got, want in zip(overlapped, in_turn, strict=True):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
        assert set(got["grads"]) == set(want["grads"])
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
        # the worker thread's exchanges all on the twin group, the caller's never: and both happen
        assert {(main, twin) for main, twin in got["calls"]} == {(True, False), (False, True)}
        assert {(main, twin) for main, twin in want["calls"]} == {(True, False)}
        assert len(got["calls"]) == len(want["calls"])


def _twins() -> list:
    dims = ParallelDims.from_config(ParallelConfig(pp=2, dp_shard=2, ep=2), dist.get_world_size())
    dims.build_mesh("cpu")
    twins = twin_groups(dims)
    ((group, twin),) = twins.items()
    assert twin is not group
    mine = dist.get_process_group_ranks(group)
    assert dist.get_process_group_ranks(twin) == mine
    probe = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(probe, group=twin)
    return [mine, probe.item()]


@pytest.mark.dist
def test_twin_groups_hold_the_same_ranks():
    got = run_ranks(_twins, 4)
    assert [g[0] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g[1] for g in got] == [1.0, 1.0, 5.0, 5.0]


def test_overlap_applies_where_every_collective_of_a_stage_has_a_lane():
    assert overlaps(ParallelDims(pp=2, ep=2, dp_shard=2, world_size=4))
    assert not overlaps(ParallelDims(pp=2, tp=2, world_size=4))
    with pytest.raises(ConfigError, match="parallel.pp_overlap='yes' is invalid: true or false"):
        ParallelConfig(pp_overlap="yes")
