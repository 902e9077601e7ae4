"""LoRA (train.lora) under every layout through the real Trainer equals the one-process run (fp32 1e-5:
losses, gradient norms and every weight, the frozen base included): dp_replicate, dp_shard (FSDP2), the
distributed optimizer, tp (each adapter's A and B cut to match the layer it wraps), tp + sp, pp, cp, and an
MoE model's attention adapters under ep; a run resumes under another layout as the straight run goes on.
A quantized base (QLoRA) is refused on ranks by name before anything is allocated."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from tests.forked_ranks import RankFailure, run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 3
LORA = {"train.lora.rank": 4, "train.lora.alpha": 8, "optim.lr": 1e-2}
_references: dict = {}


def reference(model: str, dataset: str, tmp_path_factory) -> dict:
    if model not in _references:
        run_dir = tmp_path_factory.mktemp("reference")
        _references[model] = train_one_process(model, overrides_for(model, dataset, run_dir, STEPS, **LORA))
    return _references[model]


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", [
    pytest.param("dense", 2, {"parallel.dp_shard": 2}, id="dense-fsdp2"),
    pytest.param("dense", 2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, id="dense-replicate2"),
    pytest.param("dense", 2, {"parallel.dp_shard": 2, "parallel.optimizer": "distributed"}, id="dense-distopt2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="dense-tp2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, id="dense-tp2-sp"),
    pytest.param("dense", 2, {"parallel.pp": 2, "parallel.dp_shard": 1}, id="dense-pp2"),
    pytest.param("dense", 2, {"parallel.cp": 2, "parallel.dp_shard": 1}, id="dense-cp2"),
    pytest.param("moe", 2, {"parallel.ep": 2, "parallel.dp_shard": 2}, id="moe-ep2-fsdp2"),
    pytest.param("deepseek", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="deepseek-tp2", marks=pytest.mark.slow),
    pytest.param("dense", 4, {"parallel.tp": 2, "parallel.dp_shard": 2}, id="dense-tp2-fsdp2", marks=pytest.mark.slow),
    pytest.param("dense", 4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1},
                 id="dense-pp2-tp2-sp", marks=pytest.mark.slow),
    pytest.param("moe", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, id="moe-tp2-sp",
                 marks=pytest.mark.slow),
])
def test_lora_layout_trains_like_one_process(model, world, parallel, small_dataset, tmp_path, tmp_path_factory):
    ref = reference(model, small_dataset, tmp_path_factory)
    got = run_ranks(train_on_ranks, world, model, overrides_for(model, small_dataset, tmp_path, STEPS,
                                                                **LORA, **parallel))
    assert [r["step"] for r in got[0]["records"]] == [1, 2, 3]
    assert_same_training(got, ref, rtol=1e-5)


def _adapter_placements(model: str, overrides: list[str]) -> dict:
    """Each adapter weight's placements on this rank (a tp layout) and its local shape."""
    from tessera.config.schema import load_config
    from tessera.train.trainer import Trainer
    from tests.parallel.trainer_runs import MODELS

    trainer = Trainer(load_config(MODELS[model][0], overrides))
    out = {}
    for name, p in trainer.model.named_parameters():
        if ".lora_" in name and isinstance(p, DTensor):
            out[name] = (tuple(p.placements), tuple(p.to_local().shape))
    return out


@pytest.mark.dist
def test_tp_cuts_each_adapter_as_the_layer_it_wraps(small_dataset, tmp_path):
    got = run_ranks(_adapter_placements, 2, "dense", overrides_for("dense", small_dataset, tmp_path, 1, **LORA,
                                                                    **{"parallel.tp": 2, "parallel.dp_shard": 1}))[0]
    # dim 64, kv heads 2 x 16, ffn 128: colwise B by output rows, rowwise A by input columns, the rank whole
    assert got["layers.0.attention.wq.lora_B.weight"] == ((Shard(0),), (32, 4))
    assert got["layers.0.attention.wk.lora_B.weight"] == ((Shard(0),), (16, 4))
    assert got["layers.0.attention.wq.lora_A.weight"][1] == (4, 64)
    assert got["layers.0.attention.wo.lora_A.weight"] == ((Shard(1),), (4, 32))
    assert got["layers.0.attention.wo.lora_B.weight"][1] == (64, 4)
    assert got["layers.1.feed_forward.w2.lora_A.weight"] == ((Shard(1),), (4, 64))
    assert got["layers.1.feed_forward.w3.lora_B.weight"] == ((Shard(0),), (64, 4))


@pytest.mark.dist
def test_a_lora_run_resumes_under_another_layout(small_dataset, tmp_path, tmp_path_factory):
    ref = reference("dense", small_dataset, tmp_path_factory)
    run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, tmp_path, 2, **LORA, **{
        "parallel.tp": 2, "parallel.dp_shard": 1, "checkpoint.interval": 1}))
    got = run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, tmp_path, STEPS, **LORA, **{
        "parallel.dp_shard": 2}), True)
    assert [r["step"] for r in got[0]["records"]] == [3]
    assert abs(got[0]["records"][0]["loss"] - ref["records"][2]["loss"]) <= 1e-5 * ref["records"][2]["loss"]
    for name, want in ref["weights"].items():
        torch.testing.assert_close(got[0]["weights"][name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.dist
def test_a_quantized_base_is_refused_on_ranks_by_name(small_dataset, tmp_path):
    overrides = overrides_for("dense", small_dataset, tmp_path, 1, **LORA, **{"train.lora.quantize_base": "int4"})
    with pytest.raises(RankFailure, match=r"train.lora.quantize_base='int4' trains in one process only"):
        run_ranks(train_on_ranks, 2, "dense", overrides)
