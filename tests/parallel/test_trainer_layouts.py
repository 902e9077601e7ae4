"""The real Trainer under every layout kind equals the one-process run (docs/architecture.md,
"Numerics contract").

Three training steps on the same global batches (each rank reads the whole global batch and takes
its rows) log the same losses and end with the same weights as one process: fp32 within 1e-5
relative, bf16 within 5e-3. AdamW eps is 1e-3 in these runs (trainer_runs.EQUALITY_OVERRIDES):
the default eps turns rounding noise in near-zero gradients into lr-sized differences on the first
step. The quick set holds one model per layout kind; the other model of each runs with -m slow.
"""

from __future__ import annotations

import pytest

from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 3
# Evaluation at the last step too: validation batches are cut over ranks (and pipeline micro-
# batches) like training ones; a short last batch is padded with rows that count no token.
EVAL = {"train.eval_interval": STEPS, "data.valid_fraction": 0.2, "train.eval_steps": 3}
L4 = {"model.n_layers": 4}  # two stages per rank under vpp=2
PP = {"parallel.pp": 2, "parallel.dp_shard": 1}

_references: dict = {}


def reference(model: str, dataset: str, tmp_path_factory, **extra) -> dict:
    """The one-process run (cached per model shape and precision)."""
    key = (model, repr(sorted(extra.items())))
    if key not in _references:
        run_dir = tmp_path_factory.mktemp("reference")
        _references[key] = train_one_process(model, overrides_for(model, dataset, run_dir, STEPS, **EVAL, **extra))
    return _references[key]


def _case(model: str, world: int, parallel: dict, name: str, slow: bool = False):
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(model, world, parallel, id=f"{model}-{name}", marks=marks)


FP32_LAYOUTS = [
    _case("dense", 2, {"parallel.dp_shard": 2}, "fsdp2"),
    _case("moe", 2, {"parallel.dp_shard": 2}, "fsdp2", slow=True),
    _case("moe", 2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, "replicate2"),
    _case("dense", 2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, "replicate2", slow=True),
    _case("dense", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, "tp2"),
    _case("moe", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, "tp2", slow=True),
    _case("moe", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, "tp2-sp"),
    _case("dense", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, "tp2-sp", slow=True),
    _case("dense", 2, {**PP, "parallel.pp_schedule": "gpipe"}, "pp2-gpipe"),
    _case("moe", 2, {**PP, "parallel.pp_schedule": "gpipe"}, "pp2-gpipe", slow=True),
    _case("moe", 2, {**PP, "parallel.pp_schedule": "1f1b"}, "pp2-1f1b"),
    _case("dense", 2, {**PP, "parallel.pp_schedule": "1f1b"}, "pp2-1f1b", slow=True),
    _case("dense", 2, {**PP, "parallel.pp_schedule": "zero_bubble"}, "pp2-zero-bubble"),
    _case("moe", 2, {**PP, "parallel.pp_schedule": "zero_bubble"}, "pp2-zero-bubble", slow=True),
    _case("moe", 2, {**PP, "parallel.pp_schedule": "interleaved_1f1b", "parallel.vpp": 2, **L4}, "pp2-vpp2"),
    _case("dense", 2, {**PP, "parallel.pp_schedule": "interleaved_1f1b", "parallel.vpp": 2, **L4}, "pp2-vpp2",
          slow=True),
    # two stages per rank in a V (rank 0 holds the first and the last); one row per micro-batch: 2 pp of them
    _case("moe", 2, {**PP, "parallel.pp_schedule": "dualpipev", "train.micro_batch_size": 1, **L4}, "pp2-dualpipev"),
    _case("dense", 2, {**PP, "parallel.pp_schedule": "zbv", **L4}, "pp2-zbv", slow=True),
    _case("moe", 2, {"parallel.ep": 2, "parallel.dp_shard": 2}, "ep2-fsdp2"),
    _case("dense", 4, {"parallel.tp": 2, "parallel.dp_shard": 2}, "tp2-fsdp2"),
    _case("moe", 4, {"parallel.tp": 2, "parallel.dp_shard": 2}, "tp2-fsdp2", slow=True),
    _case("dense", 4, {**PP, "parallel.tp": 2}, "pp2-tp2", slow=True),
    _case("moe", 4, {**PP, "parallel.tp": 2}, "pp2-tp2"),
    # a later stage receives its 1/tp slice of the sequence: RoPE still sees global positions
    _case("dense", 4, {**PP, "parallel.tp": 2, "parallel.sp": True}, "pp2-tp2-sp"),
    # dp = 2 leaves two rows per rank: micro-batches of one row give the 1F1B schedule one per stage.
    _case("moe", 4, {"parallel.pp": 2, "parallel.ep": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 1},
          "pp2-ep2-fsdp2"),
]


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", FP32_LAYOUTS)
def test_layout_trains_like_one_process(model, world, parallel, small_dataset, tmp_path, tmp_path_factory):
    shape = {k: v for k, v in parallel.items() if k.startswith(("model.", "train."))}
    ref = reference(model, small_dataset, tmp_path_factory, **shape)
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, small_dataset, tmp_path, STEPS, **EVAL, **parallel))
    assert [r["step"] for r in got[0]["records"]] == [1, 2, 3]
    assert_same_training(got, ref, rtol=1e-5)
    val, want = got[0]["records"][-1]["val_loss"], ref["records"][-1]["val_loss"]
    assert abs(val - want) <= 1e-5 * want


BF16_LAYOUTS = [
    _case("dense", 2, {"parallel.dp_shard": 2}, "fsdp2"),
    _case("moe", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, "tp2-sp"),
    _case("moe", 2, {**PP, "parallel.pp_schedule": "1f1b"}, "pp2-1f1b", slow=True),
    _case("moe", 2, {"parallel.ep": 2, "parallel.dp_shard": 2}, "ep2-fsdp2", slow=True),
]


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", BF16_LAYOUTS)
def test_bf16_layout_stays_within_bf16_tolerance(model, world, parallel, small_dataset, tmp_path, tmp_path_factory):
    """bf16 compute (FSDP bf16 parameters under autocast) over fp32 master weights, against the
    one-process bf16 run (autocast): within 5e-3."""
    ref = reference(model, small_dataset, tmp_path_factory, **{"train.dtype": "bf16"})
    overrides = overrides_for(model, small_dataset, tmp_path, STEPS, **EVAL, **parallel, **{"train.dtype": "bf16"})
    got = run_ranks(train_on_ranks, world, model, overrides)
    assert_same_training(got, ref, rtol=5e-3)
    fp32 = reference(model, small_dataset, tmp_path_factory)
    assert [r["loss"] for r in got[0]["records"]] != [r["loss"] for r in fp32["records"]]  # really bf16


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [
    pytest.param({"parallel.dp_shard": 2}, id="fsdp2"),
    pytest.param({**PP, "parallel.pp_schedule": "1f1b"}, id="pp2-1f1b"),
])
def test_evaluation_over_every_validation_sample(parallel, small_dataset, tmp_path):
    """155 validation samples: the last batch holds 3 of 4 rows and is padded with rows that count
    no token, so the validation loss is still the one-process value."""
    full_eval = {"train.eval_interval": 1, "data.valid_fraction": 0.2, "train.eval_steps": 1000}
    ref = train_one_process("dense", overrides_for("dense", small_dataset, tmp_path / "one", 1, **full_eval))
    got = run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, tmp_path / "ranks", 1,
                                                              **full_eval, **parallel))
    want = ref["records"][0]["val_loss"]
    assert abs(got[0]["records"][0]["val_loss"] - want) <= 1e-5 * want
