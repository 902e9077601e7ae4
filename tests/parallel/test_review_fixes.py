"""On forked ranks: the micro-batch rule of the pipeline schedules is torch's own, the MoE router
keeps fp32 weights under FSDP bf16 mixed precision, and an SFT run whose ranks and micro-batches
hold different numbers of loss tokens trains like one process."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.parallel import ParallelDims, parallelize, shard_global_batch
from tessera.parallel.pipeline import SCHEDULES, stages_of_rank
from tessera.parallel.testing import RankFailure, run_ranks
from tessera.train.data_source import build_training_data
from tessera.train.loss import token_loss_sum
from tessera.train.run_layout import schedule_accepts_microbatches
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process
from tests.parallel.training_step import global_batch
from tests.train.runs import TINY_DENSE

# ---- 1. pipeline micro-batch counts ------------------------------------------------------------

CASES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zero_bubble", 2))


def _torch_accepts(counts: list[int]) -> dict[tuple[str, int, int], bool]:
    """Which (schedule, vpp, m) torch's schedule constructors take over this world's pp ranks."""
    pp, out = dist.get_world_size(), {}
    for name, vpp in CASES:
        stages = [PipelineStage(nn.Linear(4, 4), s, pp * vpp, torch.device("cpu"), group=dist.group.WORLD)
                  for s in stages_of_rank(dist.get_rank(), pp, vpp)]
        for m in counts:
            try:
                SCHEDULES[name](stages if vpp > 1 or name != "1f1b" else stages[0], n_microbatches=m,
                                loss_fn=lambda y, t: y.sum(), scale_grads=False)
                out[(name, vpp, m)] = True
            except ValueError:
                out[(name, vpp, m)] = False
    return out


@pytest.mark.dist
@pytest.mark.parametrize("pp", [2, 4])
def test_microbatch_rule_is_torchs(pp):
    counts = list(range(pp, 5 * pp + 2))  # m < pp is refused for one stage per micro-batch, not by torch
    got = run_ranks(_torch_accepts, pp, counts)[0]
    for (name, _, m), accepted in got.items():
        assert schedule_accepts_microbatches(name, m, pp) == accepted, (name, m, accepted)
    assert not all(got.values())  # the rule does refuse some counts


@pytest.mark.dist
def test_trainer_refuses_a_count_the_schedule_rejects_before_building(small_dataset, tmp_path):
    layout = {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "interleaved_1f1b",
              "parallel.vpp": 2, "model.n_layers": 4, "train.global_batch_size": 10}
    with pytest.raises(RankFailure, match=r"ConfigError: 5 micro-batches per data-parallel rank .* "
                                          r"parallel.pp_schedule=interleaved_1f1b"):
        run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, tmp_path, 1, **layout))


# ---- 3. fp32 router under FSDP bf16 -------------------------------------------------------------

def _router_under_fsdp(param_dtype: torch.dtype, zero_stage: int) -> dict:
    cfg = get_preset("tiny-moe")
    pcfg = ParallelConfig(dp_shard=2, zero_stage=zero_stage)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    model = parallelize(Transformer(cfg, init_seed=0), dims, pcfg, param_dtype=param_dtype)
    seen: dict[str, list] = {}

    def record(name):
        def hook(module, args):  # runs after FSDP's own pre-forward hook has gathered the weight
            seen.setdefault(name, []).append(module.weight.detach().clone())
        return hook

    for key, block in model.layers.items():
        block.moe.router.register_forward_pre_hook(record(f"router{key}"))
    model.layers["0"].attention.wq.register_forward_pre_hook(record("wq"))
    batch = global_batch(cfg.vocab_size)
    rows = shard_global_batch(batch, dims)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype == torch.bfloat16):
        out = model(rows[:, :-1])
        loss = token_loss_sum(out.logits, rows[:, 1:]) / batch[:, 1:].numel() + out.aux_loss
    loss.backward()
    router = model.layers["0"].moe.router
    master = router.weight.full_tensor()
    return {"seen_dtypes": {k: [w.dtype for w in v] for k, v in seen.items()},
            "seen_is_master": torch.equal(seen["router0"][0], master),
            "master_dtype": router.weight.dtype, "own_unit": isinstance(router, FSDPModule),
            "grad": (isinstance(router.weight.grad, DTensor), router.weight.grad.dtype,
                     float(router.weight.grad.full_tensor().abs().sum()))}


@pytest.mark.dist
@pytest.mark.parametrize("zero_stage", [3, 2])
def test_router_stays_fp32_under_bf16_fsdp(zero_stage):
    for r in run_ranks(_router_under_fsdp, 2, torch.bfloat16, zero_stage):
        assert r["seen_dtypes"]["wq"] == [torch.bfloat16]  # the layout really computes in bf16 ...
        assert r["seen_dtypes"]["router0"] == r["seen_dtypes"]["router1"] == [torch.float32]  # ... but routes in fp32
        assert r["seen_is_master"]  # the fp32 master weights themselves, not bf16-rounded ones
        assert r["own_unit"] and r["master_dtype"] == torch.float32
        assert r["grad"][:2] == (True, torch.float32) and r["grad"][2] > 0  # backward (re)gathers it too


@pytest.mark.dist
def test_fp32_fsdp_keeps_the_router_inside_its_block():
    """fp32 layouts are unchanged (bit-identical losses): no extra FSDP unit for the router."""
    for r in run_ranks(_router_under_fsdp, 2, torch.float32, 3):
        assert not r["own_unit"] and r["seen_dtypes"]["router0"] == [torch.float32]


# ---- 5. loss normalisation over ranks with an answer-only mask ---------------------------------

def _sft_dataset(directory) -> str:
    """Conversations whose answers range from one word to twenty: windows of 33 packed tokens hold very
    different numbers of answer tokens."""
    from tessera.data import default_tokenizer, preprocess_sft

    rng = random.Random(0)
    words = "the a model token loss rank batch layer weight value answer question".split()
    records = []
    for i in range(120):
        prompt = " ".join(rng.choice(words) for _ in range(rng.choice([2, 12])))
        response = " ".join(rng.choice(words) for _ in range(rng.choice([1, 4, 20])))
        records.append({"prompt": f"{i}: {prompt}?", "response": response})
    (directory / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess_sft([directory / "chat.jsonl"], directory / "sft", default_tokenizer(), show_progress=False)
    return str(directory / "sft")


@pytest.mark.dist
def test_sft_unequal_loss_tokens_per_rank_train_like_one_process(tmp_path):
    dataset = _sft_dataset(tmp_path)
    steps = 3
    # Two ranks of two micro-batches of one sample each.
    extra = {"data.kind": "sft", "train.micro_batch_size": 1, "train.global_batch_size": 4,
             "train.eval_interval": steps, "data.valid_fraction": 0.2, "train.eval_steps": 2}
    one = overrides_for("dense", dataset, tmp_path / "one", steps, **extra)
    data = build_training_data(load_config(TINY_DENSE, one))
    for _ in range(steps):
        per_row = data.train.next_batch().target_mask.sum(dim=1).tolist()  # rank r reads rows 2r, 2r + 1
        assert sum(per_row[:2]) != sum(per_row[2:]), per_row  # a mean of per-rank means would differ
        assert per_row[0] != per_row[1] and per_row[2] != per_row[3], per_row  # and per micro-batch
        assert 0 < sum(per_row) < 4 * 32  # answer-only: the mask drops the prompts
    ref = train_one_process("dense", one)
    got = run_ranks(train_on_ranks, 2, "dense",
                    overrides_for("dense", dataset, tmp_path / "ranks", steps, **extra, **{"parallel.dp_shard": 2}))
    assert [r["loss_tokens"] for r in got[0]["records"]] == [r["loss_tokens"] for r in ref["records"]]
    assert_same_training(got, ref, rtol=1e-5)
    val, want = got[0]["records"][-1]["val_loss"], ref["records"][-1]["val_loss"]
    assert abs(val - want) <= 1e-5 * want
