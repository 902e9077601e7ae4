"""FSDP mixed precision: bf16 compute weights with fp32 master shards and fp32 gradient
reduction stay within the bf16 tolerance of the fp32 single-process loss (DESIGN.md: 5e-3)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.parallel import ParallelDims, global_sum, parallelize, shard_global_batch
from tessera.parallel.testing import run_ranks
from tessera.train.loss import token_loss_sum
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
