"""Vocabulary-parallel cross-entropy equals the full-vocabulary loss (value and gradient), with a
loss mask and ignored targets, and never needs the whole vocabulary on one rank."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tessera.train.objectives.loss import token_loss_sum
from tests.forked_ranks import run_ranks

B, S, V = 2, 5, 12


def _data():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, S, V, generator=g) * 3
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[0, 0] = -100
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, -2:] = False
    return logits, targets, mask


def _reference():
    logits, targets, mask = _data()
    logits.requires_grad_()
    t = targets.masked_fill(~mask, -100)
    loss = F.cross_entropy(logits.reshape(-1, V), t.reshape(-1), ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), logits.grad


def _on_rank():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    logits, targets, mask = _data()
    logits.requires_grad_()
    local = logits.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()]
    assert local.shape[-1] == V // dist.get_world_size()
    sharded = DTensor.from_local(local, mesh, [Shard(2)])
    loss = token_loss_sum(sharded, targets, mask)
    loss.backward()
    return loss.detach(), logits.grad


@pytest.mark.dist
def test_vocab_parallel_loss_matches_full_cross_entropy():
    ref_loss, ref_grad = _reference()
    results = run_ranks(_on_rank, 2)
    for rank, (loss, grad) in enumerate(results):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        cols = slice(rank * V // 2, (rank + 1) * V // 2)
        torch.testing.assert_close(grad[..., cols], ref_grad[..., cols], rtol=1e-6, atol=1e-7)
        other = torch.ones(V, dtype=torch.bool)
        other[cols] = False
        assert torch.count_nonzero(grad[..., other]) == 0  # only the local slice was touched


def test_plain_logits_take_the_single_process_path():
    logits, targets, mask = _data()
    ref_loss, _ = _reference()
    torch.testing.assert_close(token_loss_sum(logits, targets, mask), ref_loss)
