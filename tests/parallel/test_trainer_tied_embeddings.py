"""Tied embeddings (`model.tie_embeddings=true`: the LM head is the embedding matrix) under tensor and
pipeline parallelism, through the real Trainer, equal one process (fp32 within 1e-5 relative).

- tp: the vocabulary-parallel embedding and the head share one DTensor weight, sharded on the
  vocabulary; the head computes this rank's slice of the logits from it (`VocabParallelTiedHead`).
- pp: the first and last stage each hold a copy; their gradients are summed before the optimizer
  step and the norm counts the matrix once, so both copies stay bit-for-bit equal; a checkpoint
  holds it once and resumes under another layout (tessera/parallel/tied_embeddings.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 3
TIED = {"model.tie_embeddings": True}
EVAL = {"train.eval_interval": STEPS, "data.valid_fraction": 0.2, "train.eval_steps": 2}
PP2 = {"parallel.pp": 2, "parallel.dp_shard": 1}
TP2 = {"parallel.tp": 2, "parallel.dp_shard": 1}

_references: dict = {}


def _reference(dataset: str, tmp_path_factory) -> dict:
    if "tied" not in _references:
        run_dir = tmp_path_factory.mktemp("reference")
        _references["tied"] = train_one_process("dense", overrides_for("dense", dataset, run_dir, STEPS, **TIED,
                                                                       **EVAL))
    return _references["tied"]


@pytest.mark.dist
@pytest.mark.parametrize("world,parallel", [
    pytest.param(2, TP2, id="tp2"),
    pytest.param(2, {**PP2, "parallel.pp_schedule": "1f1b"}, id="pp2-1f1b"),
    pytest.param(2, {**TP2, "parallel.sp": True}, id="tp2-sp"),
    pytest.param(2, {**PP2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.vpp": 2, "model.n_layers": 4},
                 id="pp2-vpp2"),
    pytest.param(4, {**PP2, "parallel.tp": 2}, id="pp2-tp2", marks=pytest.mark.slow),
    pytest.param(4, {"parallel.pp": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 1}, id="pp2-fsdp2",
                 marks=pytest.mark.slow),
    # Four stages: the first and last stage's ranks sum the gradient, the middle ones take no part.
    pytest.param(4, {"parallel.pp": 4, "parallel.dp_shard": 1, "model.n_layers": 4, "train.micro_batch_size": 1},
                 id="pp4", marks=pytest.mark.slow),
])
def test_tied_embeddings_train_like_one_process(world, parallel, small_dataset, tmp_path, tmp_path_factory):
    shape = {k: v for k, v in parallel.items() if k.startswith("model.")}
    if shape:
        ref = train_one_process("dense", overrides_for("dense", small_dataset, tmp_path / "one", STEPS, **TIED,
                                                       **EVAL, **shape))
    else:
        ref = _reference(small_dataset, tmp_path_factory)
    got = run_ranks(train_on_ranks, world, "dense",
                    overrides_for("dense", small_dataset, tmp_path / "ranks", STEPS, **TIED, **EVAL, **parallel))
    assert "output.weight" not in got[0]["weights"]  # really tied
    assert_same_training(got, ref, rtol=1e-5)
    val, want = got[0]["records"][-1]["val_loss"], ref["records"][-1]["val_loss"]
    assert abs(val - want) <= 1e-5 * want
    if "parallel.pp" in parallel:  # the first and last stage's copies stay identical
        copies = [r["weights"]["tok_embeddings.weight"] for r in got if "tok_embeddings.weight" in r["weights"]]
        assert len(copies) == 2 * world // parallel["parallel.pp"]
        assert all(torch.equal(c, copies[0]) for c in copies)


@pytest.mark.dist
def test_tied_pipeline_checkpoint_holds_the_embedding_once_and_resumes_under_tp(small_dataset, tmp_path):
    """Saved under pp=2 (both stages save `tok_embeddings.weight`), the checkpoint stores one copy;
    resumed under tp=2 it continues with the losses of an uninterrupted one-process run."""
    ref = train_one_process("dense", overrides_for("dense", small_dataset, tmp_path / "reference", 3, **TIED))
    run = tmp_path / "run"
    run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, run, 2, **TIED, **PP2))
    metadata = dcp.FileSystemReader(str(run / "checkpoints" / "step_00000002")).read_metadata()
    stored = metadata.state_dict_metadata
    assert "model.output.weight" not in stored
    for key in ("model.tok_embeddings.weight", "optim.state.tok_embeddings.weight.exp_avg"):
        assert len(stored[key].chunks) == 1, key  # written by one rank, not by both stages
    resumed = run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, run, 3, **TIED, **TP2),
                        resume=True)
    assert resumed[0]["start_step"] == 2
    assert_same_training(resumed, {"records": ref["records"][2:], "weights": ref["weights"]}, rtol=1e-5)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("parallel", [
    pytest.param({"parallel.tp": 2, "parallel.dp_shard": 2}, id="tp2-fsdp2"),
    pytest.param({"parallel.pp": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 1}, id="pp2-fsdp2"),
])
def test_bf16_tied_embeddings_stay_within_bf16_tolerance(parallel, small_dataset, tmp_path):
    """bf16 compute (FSDP bf16 parameters under autocast) over fp32 masters: within 5e-3 of one process."""
    bf16 = {"train.dtype": "bf16", **TIED}
    ref = train_one_process("dense", overrides_for("dense", small_dataset, tmp_path / "one", STEPS, **bf16))
    got = run_ranks(train_on_ranks, 4, "dense", overrides_for("dense", small_dataset, tmp_path / "ranks", STEPS,
                                                              **bf16, **parallel))
    assert_same_training(got, ref, rtol=5e-3)
