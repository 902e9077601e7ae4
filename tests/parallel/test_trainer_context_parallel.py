"""Context parallelism through the real Trainer equals the one-process run (docs/architecture.md,
"Numerics contract"): every sequence split into cp chunks, attention over the whole sequence by all-to-all,
the loss-token count that of the whole global batch, MoE router statistics over the whole
micro-batch; also with the ring and all-gather attention over the zig-zag split
(`parallel.cp_method`). fp32 within 1e-5 relative: logged losses (and MoE aux losses), validation
loss and the final weights."""

from __future__ import annotations

import pytest

from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 2
EVAL = {"train.eval_interval": STEPS, "data.valid_fraction": 0.2, "train.eval_steps": 2}
CP2 = {"parallel.cp": 2, "parallel.dp_shard": 1}
PP2 = {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}

_references: dict = {}


def _reference(model: str, dataset: str, tmp_path_factory) -> dict:
    if model not in _references:
        run_dir = tmp_path_factory.mktemp("reference")
        _references[model] = train_one_process(model, overrides_for(model, dataset, run_dir, STEPS, **EVAL))
    return _references[model]


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", [
    pytest.param("dense", 2, CP2, id="dense-cp2"),
    pytest.param("moe", 2, CP2, id="moe-cp2"),
    # tp=2 leaves one kv head per rank for two cp ranks: the kv heads are repeated before the all-to-all.
    pytest.param("dense", 4, {**CP2, "parallel.tp": 2}, id="dense-cp2-tp2"),
    pytest.param("moe", 4, {"parallel.cp": 2, "parallel.dp_shard": 2}, id="moe-cp2-fsdp2", marks=pytest.mark.slow),
    # Experts fold over dp_shard x cp: each of the four ranks holds two of the eight experts.
    pytest.param("moe", 4, {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.ep": 4}, id="moe-cp2-fsdp2-ep4"),
    pytest.param("moe", 4, {**CP2, **PP2}, id="moe-pp2-cp2"),
    pytest.param("dense", 4, {**CP2, **PP2}, id="dense-pp2-cp2", marks=pytest.mark.slow),
    # The zig-zag split (rank r holds chunks r and 2 cp - 1 - r) with the ring and all-gather cores.
    pytest.param("moe", 2, {**CP2, "parallel.cp_method": "ring"}, id="moe-cp2-ring"),
    pytest.param("dense", 2, {**CP2, "parallel.cp_method": "ring"}, id="dense-cp2-ring"),
    pytest.param("moe", 2, {**CP2, "parallel.cp_method": "allgather"}, id="moe-cp2-allgather"),
    pytest.param("dense", 2, {**CP2, "parallel.cp_method": "allgather"}, id="dense-cp2-allgather"),
    pytest.param("dense", 4, {**CP2, "parallel.tp": 2, "parallel.cp_method": "ring"}, id="dense-cp2-tp2-ring"),
    pytest.param("moe", 4, {"parallel.cp": 4, "parallel.dp_shard": 1, "parallel.cp_method": "ring"},
                 id="moe-cp4-ring", marks=pytest.mark.slow),
    pytest.param("moe", 4, {**CP2, **PP2, "parallel.cp_method": "ring"}, id="moe-pp2-cp2-ring", marks=pytest.mark.slow),
    pytest.param("moe", 4, {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.cp_method": "ring",
                            "parallel.recompute": "selective"}, id="moe-cp2-fsdp2-ring-recompute",
                 marks=pytest.mark.slow),
])
def test_context_parallel_trains_like_one_process(model, world, parallel, small_dataset, tmp_path, tmp_path_factory):
    ref = _reference(model, small_dataset, tmp_path_factory)
    got = run_ranks(train_on_ranks, world, model, overrides_for(model, small_dataset, tmp_path, STEPS, **EVAL,
                                                                **parallel))
    assert [r["step"] for r in got[0]["records"]] == list(range(1, STEPS + 1))
    assert_same_training(got, ref, rtol=1e-5)
    val, want = got[0]["records"][-1]["val_loss"], ref["records"][-1]["val_loss"]
    assert abs(val - want) <= 1e-5 * want


@pytest.mark.dist
@pytest.mark.parametrize("routing,method", [
    pytest.param({"model.moe.seq_aux_loss_coef": 0.01}, "alltoall", id="seq-aux-loss-alltoall"),
    pytest.param({"model.moe.seq_aux_loss_coef": 0.01}, "ring", id="seq-aux-loss-ring"),
    pytest.param({"model.moe.sinkhorn": True}, "alltoall", id="sinkhorn-alltoall"),
    pytest.param({"model.moe.sinkhorn": True, "model.moe.capacity_factor": 1.0}, "allgather",
                 id="sinkhorn-capacity-allgather", marks=pytest.mark.slow),
])
def test_sequence_aux_loss_and_sinkhorn_under_cp_train_like_one_process(routing, method, small_dataset, tmp_path):
    """The sequence-level balancing loss (each sequence's routing counts summed over cp) and Sinkhorn
    routing (its column sums over cp) under cp=2 equal one process, with either split."""
    ref = train_one_process("moe", overrides_for("moe", small_dataset, tmp_path / "one", STEPS, **routing))
    got = run_ranks(train_on_ranks, 2, "moe", overrides_for("moe", small_dataset, tmp_path / "cp", STEPS, **routing,
                                                            **CP2, **{"parallel.cp_method": method}))
    assert_same_training(got, ref, rtol=1e-5)
    aux = [k for k in ref["records"][0] if "seq_load_balancing" in k]
    assert aux or "model.moe.sinkhorn" in routing, sorted(ref["records"][0])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("recompute,method", [("none", "alltoall"), ("selective", "alltoall"), ("selective", "ring")])
def test_bf16_context_parallel_stays_within_bf16_tolerance(recompute, method, small_dataset, tmp_path):
    """bf16 autocast (FSDP bf16 compute weights) under cp, with and without recomputing the
    attention core (whose all-to-alls or ring passes then run again in backward): within 5e-3 of
    one process."""
    bf16 = {"train.dtype": "bf16"}
    ref = train_one_process("moe", overrides_for("moe", small_dataset, tmp_path / "one", STEPS, **bf16))
    got = run_ranks(train_on_ranks, 2, "moe", overrides_for("moe", small_dataset, tmp_path / "cp", STEPS, **bf16,
                                                            **CP2, **{"parallel.recompute": recompute,
                                                                      "parallel.cp_method": method}))
    assert_same_training(got, ref, rtol=5e-3)


@pytest.mark.dist
def test_checkpoint_of_cp_run_resumes_under_tp(small_dataset, tmp_path):
    """A checkpoint written under cp=2 (FSDP shards over the cp ranks) resumes under tp=2 and
    continues with the losses of an uninterrupted one-process run."""
    ref = train_one_process("dense", overrides_for("dense", small_dataset, tmp_path / "reference", 3))
    run = tmp_path / "run"
    run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, run, 2, **CP2))
    resumed = run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, run, 3, **{
        "parallel.tp": 2, "parallel.dp_shard": 1}), resume=True)
    assert resumed[0]["start_step"] == 2
    assert_same_training(resumed, {"records": ref["records"][2:], "weights": ref["weights"]}, rtol=1e-5)
