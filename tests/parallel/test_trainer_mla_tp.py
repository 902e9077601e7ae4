"""Multi-head latent attention under tensor parallelism, through the real Trainer, equals one process
(docs/architecture.md, "Numerics contract"; fp32 within 1e-5 relative): configs/tiny-deepseek.yaml
(MLA, a dense first layer, sigmoid router with group-limited top-k and expert bias, a shared expert, the
sequence-level balancing loss) for three steps, with its weights' gradient exact on every rank.

The heads are split over tp (q and kv up-projections by heads, the output projection by rows); the
low-rank down-projections, their norms and the decoupled RoPE key are replicated, and the RoPE
key's gradient is summed over the ranks' heads (`SumOverRanksHeads`): without that sum the
gradient of `wkv_a` would be that of this rank's heads only, and these tests fail.
"""

from __future__ import annotations

import dataclasses

import pytest

from tessera.config import get_preset
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process
from tests.parallel.training_step import assert_same_step, layout_step, reference_step

STEPS = 3
EVAL = {"train.eval_interval": STEPS, "data.valid_fraction": 0.2, "train.eval_steps": 2}
TP2 = {"parallel.tp": 2, "parallel.dp_shard": 1}

_references: dict = {}


def _reference(dataset: str, tmp_path_factory) -> dict:
    if "deepseek" not in _references:
        run_dir = tmp_path_factory.mktemp("reference")
        _references["deepseek"] = train_one_process("deepseek", overrides_for("deepseek", dataset, run_dir, STEPS,
                                                                              **EVAL))
    return _references["deepseek"]


@pytest.mark.dist
@pytest.mark.parametrize("world,parallel", [
    pytest.param(2, TP2, id="tp2"),
    pytest.param(4, {"parallel.tp": 2, "parallel.dp_shard": 2}, id="tp2-fsdp2"),
    pytest.param(2, {"parallel.cp": 2, "parallel.dp_shard": 1}, id="cp2"),  # seq aux loss over the cp group
    pytest.param(2, {"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_method": "ring"}, id="cp2-ring"),
    pytest.param(2, {**TP2, "parallel.sp": True}, id="tp2-sp", marks=pytest.mark.slow),
    pytest.param(4, {**TP2, "parallel.ep": 2, "parallel.dp_shard": 2}, id="tp2-ep2-fsdp2", marks=pytest.mark.slow),
])
def test_tiny_deepseek_under_tp_and_cp_trains_like_one_process(world, parallel, small_dataset, tmp_path,
                                                              tmp_path_factory):
    ref = _reference(small_dataset, tmp_path_factory)
    got = run_ranks(train_on_ranks, world, "deepseek",
                    overrides_for("deepseek", small_dataset, tmp_path, STEPS, **EVAL, **parallel))
    assert [r["step"] for r in got[0]["records"]] == [1, 2, 3]
    assert "aux/layer1/seq_load_balancing" in got[0]["records"][0]
    assert_same_training(got, ref, rtol=1e-5)
    val, want = got[0]["records"][-1]["val_loss"], ref["records"][-1]["val_loss"]
    assert abs(val - want) <= 1e-5 * want


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [
    pytest.param(dict(tp=2, dp_shard=1), id="tp2"),
    pytest.param(dict(tp=2, sp=True, dp_shard=1), id="tp2-sp"),
])
def test_mla_gradients_under_tp_are_exact(parallel):
    """Every gradient (wq_a, q_norm, wkv_a, kv_norm included) and the clipped update equal one
    process's; the tiny-deepseek preset's MLA has a query latent (q_lora_rank)."""
    got = run_ranks(layout_step, 2, "tiny-deepseek", parallel)
    assert_same_step(got[0], reference_step("tiny-deepseek", 1))
    assert "layers.0.attention.wkv_a.weight" in got[0]["grads"]


@pytest.mark.dist
def test_mla_without_query_latent_under_tp():
    """MLA with one full query projection (q_lora_rank None, DeepSeek-V2-Lite): `wq` splits by heads."""
    mla = dataclasses.replace(get_preset("tiny-deepseek").mla, q_lora_rank=None)
    got = run_ranks(layout_step, 2, "tiny-deepseek", dict(tp=2, dp_shard=1), config_overrides={"mla": mla})
    assert_same_step(got[0], reference_step("tiny-deepseek", 1, {"mla": mla}))


@pytest.mark.dist
@pytest.mark.slow
def test_bf16_tiny_deepseek_under_tp_fsdp_stays_within_bf16_tolerance(small_dataset, tmp_path):
    """bf16 compute over fp32 master weights (fp32 router): within 5e-3 of the one-process bf16 run."""
    bf16 = {"train.dtype": "bf16"}
    ref = train_one_process("deepseek", overrides_for("deepseek", small_dataset, tmp_path / "one", STEPS, **bf16))
    got = run_ranks(train_on_ranks, 4, "deepseek", overrides_for("deepseek", small_dataset, tmp_path / "ranks", STEPS,
                                                                 **bf16, **{"parallel.tp": 2, "parallel.dp_shard": 2}))
    assert_same_training(got, ref, rtol=5e-3)
