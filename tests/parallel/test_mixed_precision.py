"""FSDP mixed precision: bf16 compute weights with fp32 master shards and fp32 gradient
reduction stay within the bf16 tolerance of the fp32 single-process loss (docs/architecture.md,
"Numerics contract": 5e-3); the MoE router keeps computing with its fp32 master weights."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.parallel import ParallelDims, global_sum, parallelize, shard_global_batch
from tessera.train.objectives.loss import token_loss_sum
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import global_batch, reference_step


def _bf16_step():
    cfg = get_preset("tiny-llama")
    pcfg = ParallelConfig(dp_shard=2)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    model = parallelize(Transformer(cfg, init_seed=0), dims, pcfg, param_dtype=torch.bfloat16)
    batch = global_batch(cfg.vocab_size)
    rows = shard_global_batch(batch, dims)
    out = model(rows[:, :-1])
    loss = token_loss_sum(out.logits, rows[:, 1:]) / batch[:, 1:].numel()
    loss.backward()
    p = model.layers["0"].attention.wq.weight
    return {"loss": global_sum(loss, dims).item(), "logits_dtype": out.logits.dtype,
            "master": (isinstance(p, DTensor), p.dtype, p.grad.dtype)}


@pytest.mark.dist
def test_bf16_params_fp32_master_and_reduction():
    ref = reference_step("tiny-llama", 2)["loss1"]
    results = run_ranks(_bf16_step, 2)
    for r in results:
        assert r["logits_dtype"] == torch.bfloat16
        assert r["master"] == (True, torch.float32, torch.float32)
        assert abs(r["loss"] - ref) <= 5e-3 * abs(ref)


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
    """fp32 layouts keep the router inside its block's FSDP unit: no extra unit (nothing to keep in fp32)."""
    for r in run_ranks(_router_under_fsdp, 2, torch.float32, 3):
        assert not r["own_unit"] and r["seen_dtypes"]["router0"] == [torch.float32]
