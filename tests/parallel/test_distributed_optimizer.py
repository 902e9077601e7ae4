"""`parallel.optimizer=distributed` (tessera/parallel/distributed_optimizer.py) through the real
Trainer on forked gloo ranks: the same training as one process, the collectives the bucket sizes
imply, reduce-scatters issued while backward is still running, and a resume of its sharded state."""

from __future__ import annotations

import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import load_config
from tessera.train.trainer import Trainer
from tests.forked_ranks import RankFailure, run_ranks
from tests.hang_guard import HANG_S
from tests.parallel.trainer_runs import (
    MODELS,
    assert_same_training,
    overrides_for,
    train_on_ranks,
    train_one_process,
)

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
    # dp_shard without FSDP: two batch slices read at once, the weights replicated over both
    pytest.param("dense", 2, {**DISTRIBUTED, "parallel.dp_shard": 2}, id="dense-dp2", marks=pytest.mark.slow),
    # experts split over ep=2 and reduced over their expert-data-parallel peers (dp_replicate=2)
    pytest.param("moe", 4, {**REPLICATE2, "parallel.dp_shard": 2, "parallel.ep": 2}, id="moe-replicate2-ep2"),
    pytest.param("moe", 2, {**DISTRIBUTED, "parallel.cp": 2, "parallel.dp_shard": 1}, id="moe-cp2"),
    pytest.param("moe", 2, {**DISTRIBUTED, "parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_method": "ring"},
                 id="moe-cp2-ring"),
    # pipeline stages: one optimizer per stage part, reduce-scatters after the schedule
    pytest.param("dense", 4, {**REPLICATE2, "parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
                 id="dense-pp2-replicate2"),
    pytest.param("moe", 4, {**REPLICATE2, "parallel.pp": 2, "parallel.pp_schedule": "zero_bubble"},
                 id="moe-pp2-zero-bubble-replicate2", marks=pytest.mark.slow),
    pytest.param("moe", 2, {**DISTRIBUTED, "parallel.pp": 2, "parallel.dp_shard": 1, "model.n_layers": 4,
                            "parallel.pp_schedule": "interleaved_1f1b", "parallel.vpp": 2}, id="moe-pp2-vpp2",
                 marks=pytest.mark.slow),
    pytest.param("dense", 4, {**REPLICATE2, "parallel.tp": 2}, id="dense-replicate2-tp2", marks=pytest.mark.slow),
    pytest.param("moe", 4, {**REPLICATE2, "parallel.tp": 2}, id="moe-replicate2-tp2", marks=pytest.mark.slow),
    # bf16: replicated bf16 weights (the router's fp32) over fp32 master shards, the 5e-3 contract
    pytest.param("moe", 2, {**REPLICATE2, "train.dtype": "bf16"}, id="moe-replicate2-bf16", marks=pytest.mark.slow),
])
def test_distributed_optimizer_trains_as_one_process(model, world, layout, small_dataset, tmp_path):
    # micro-batch 1: two micro-batches per rank and step, so gradients accumulate before the reduction
    extra = {**EVAL, "train.micro_batch_size": 1, **{k: v for k, v in layout.items() if not k.startswith("parallel.")}}
    ref = train_one_process(model, overrides_for(model, small_dataset, tmp_path / "one", STEPS, **extra))
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, small_dataset, tmp_path / "dist", STEPS, **{**extra, **layout}),
                    timeout=HANG_S)
    assert_same_training(got, ref, rtol=5e-3 if "train.dtype" in layout else 1e-5)
    # (the model and precision keys of a layout go to the reference too)


def _analytic_buckets(named_numels: list[tuple[str, int]], bucket_mb: float, world: int) -> list[int]:
    """Padded element counts of the buckets: parameters in reverse order (backward's), a bucket
    closed once it holds >= bucket_mb MiB of fp32 gradient, padded to a multiple of the dp size."""
    sizes: list[int] = []
    for _, numel in reversed(named_numels):
        if not sizes or 4 * sizes[-1] >= bucket_mb * 2**20:
            sizes.append(0)
        sizes[-1] += numel
    return [-(-n // world) * world for n in sizes]


def _train_with_comm_stats(overrides: list[str]) -> dict:
    trainer = Trainer(load_config(MODELS["dense"][0], overrides))
    shapes = [(n, p.numel()) for n, p in trainer.model.named_parameters()]
    return {"records": trainer.train().records, "shapes": shapes}


@pytest.mark.dist
def test_comm_stats_count_one_reduce_scatter_and_one_all_gather_per_bucket(small_dataset, tmp_path):
    # Two micro-batches per rank: the first only accumulates, so each step reduces each bucket once.
    overrides = overrides_for("dense", small_dataset, tmp_path, 2, **REPLICATE2, **{
        "log.comm_stats": True, "train.micro_batch_size": 1})
    results = run_ranks(_train_with_comm_stats, 2, overrides, timeout=HANG_S)
    buckets = _analytic_buckets(results[0]["shapes"], 0.1, world=2)
    assert len(buckets) >= 4  # embedding, head and the blocks cut in pieces
    world = 2
    for rec in results[0]["records"]:
        # reduce-scatter: the fp32 bucket in; all-gather: the fp32 bucket out, on each rank
        assert rec["comm/reduce_scatter_calls"] == world * len(buckets)
        assert rec["comm/reduce_scatter_bytes"] == world * 4 * sum(buckets)
        assert rec["comm/all_gather_calls"] == world * len(buckets)
        assert rec["comm/all_gather_bytes"] == world * 4 * sum(buckets)
        # loss tokens (fp64), the loss statistics (two fp64) and the squared gradient norm (fp32)
        assert rec["comm/all_reduce_calls"] == world * 3
        assert rec["comm/all_reduce_bytes"] == world * (8 + 2 * 8 + 4)


def _record_gradient_order(overrides: list[str]) -> dict:
    """Every parameter's gradient, in the order backward delivers it, with the reduce-scatters the
    distributed optimizer had issued by then (the test's hooks run after the optimizer's own)."""
    trainer = Trainer(load_config(MODELS["dense"][0], overrides))
    optimizer = trainer.optimizers[0]
    events: list[tuple[str, int]] = []
    for name, p in trainer.model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda _p, name=name: events.append((name, optimizer.reduce_scatters_launched)))
    trainer.train_step()
    # The step left every bucket's all-gather in flight; the embedding's forward waits for its own only.
    in_flight = [b.gather_work is not None for b in optimizer.buckets]
    trainer.model.tok_embeddings(torch.zeros(1, 4, dtype=torch.long))
    after_embedding = [b.gather_work is not None for b in optimizer.buckets]
    return {"events": events, "buckets": len(optimizer.buckets), "in_flight": in_flight,
            "after_embedding": after_embedding}


@pytest.mark.dist
def test_reduce_scatters_run_during_backward_and_all_gathers_until_first_use(small_dataset, tmp_path):
    overrides = overrides_for("dense", small_dataset, tmp_path, 1, **REPLICATE2, **{"train.micro_batch_size": 1})
    for result in run_ranks(_record_gradient_order, 2, overrides, timeout=HANG_S):
        events, buckets = result["events"], result["buckets"]
        first, last = events[:len(events) // 2], events[len(events) // 2:]  # the two micro-batches
        assert all(launched == 0 for _, launched in first)  # accumulation only: no communication
        assert last[-1][0] == "tok_embeddings.weight"  # the last gradient of backward
        launched = [n for _, n in last]
        assert launched == sorted(launched) and launched[-1] == buckets
        # Most buckets were on the wire before the last gradient existed: issued during backward.
        assert launched[-2] == buckets - 1 and buckets >= 4
        assert len(set(launched)) == buckets  # one launch point per bucket, spread over the backward
        assert all(result["in_flight"])
        assert result["after_embedding"] == [True] * (buckets - 1) + [False]  # the embedding is the last bucket


@pytest.mark.dist
@pytest.mark.parametrize("layout", [
    pytest.param(REPLICATE2, id="replicate2"),
    # two stage parts per rank: two optimizers whose shards must not collide in the checkpoint
    pytest.param({**DISTRIBUTED, "parallel.pp": 2, "parallel.dp_shard": 1, "model.n_layers": 4,
                  "parallel.pp_schedule": "interleaved_1f1b", "parallel.vpp": 2},
                 id="pp2-vpp2", marks=pytest.mark.slow),
])
def test_sharded_state_resumes_under_the_same_layout_only(layout, small_dataset, tmp_path):
    straight = run_ranks(train_on_ranks, 2, "dense",
                         overrides_for("dense", small_dataset, tmp_path / "straight", 4, **layout), timeout=HANG_S)
    run = tmp_path / "resumed"
    run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, run, 2, **layout), timeout=HANG_S)
    resumed = run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, run, 4, **layout),
                        resume=True, timeout=HANG_S)
    assert resumed[0]["start_step"] == 2
    want = {r["step"]: r["loss"] for r in straight[0]["records"]}
    for r in resumed[0]["records"]:
        assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-6)
    for name, w in straight[0]["weights"].items():
        assert float((resumed[0]["weights"][name] - w).abs().max()) <= 1e-6 * float(w.abs().max()), name
    other = overrides_for("dense", small_dataset, run, 6, **{**layout, "parallel.bucket_mb": 0.2})
    with pytest.raises(RankFailure, match="resumes only under the layout that wrote it"):
        run_ranks(train_on_ranks, 2, "dense", other, resume=True, timeout=HANG_S)


@pytest.mark.parametrize("values,message", [
    ({"optimizer": "zero1"}, r"parallel.optimizer='zero1' is invalid: one of fsdp, distributed"),
    ({"optimizer": "distributed", "bucket_mb": 0}, r"parallel.bucket_mb=0 is invalid"),
])
def test_bad_or_unsupported_settings_are_refused_naming_the_keys(values, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**values)



def _build_trainer(overrides: list[str]) -> None:
    Trainer(load_config(MODELS["dense"][0], overrides))


@pytest.mark.dist
@pytest.mark.parametrize("setting,message", [
    ({"train.dtype": "fp16"}, "ConfigError: parallel.optimizer=distributed with train.dtype=fp16 is not"),
    ({"train.compile": True}, "ConfigError: train.compile=true is invalid with parallel.optimizer=distributed: "),
], ids=["fp16", "compile"])
def test_unsupported_settings_are_refused_naming_both_keys(small_dataset, tmp_path, setting, message):
    """An explicit train.compile=true is refused; unset, it is off here (on CUDA too: test_compile.py)."""
    overrides = overrides_for("dense", small_dataset, tmp_path, 1, **REPLICATE2, **setting)
    with pytest.raises(RankFailure, match=message):
        run_ranks(_build_trainer, 2, overrides, timeout=HANG_S)
