"""Router balancing losses stay micro-batch-wide when a micro-batch's tokens are spread over
ranks (as context parallelism spreads them): with `MicroBatchCountReducer` the ranks' losses and
router gradients add up to the single-process ones."""

import pytest
import torch
import torch.distributed as dist

from tessera.config.model import MoEConfig
from tessera.models.moe import Router
from tessera.parallel.expert_parallel import MicroBatchCountReducer
from tessera.parallel.testing import run_ranks

D, T = 16, 12
CFG = MoEConfig(num_experts=4, top_k=2, ffn_dim=8, aux_loss_coef=0.1, z_loss_coef=0.01)


def _router() -> Router:
    router = Router(D, CFG)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(5)))
    return router


def _tokens() -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(6))


def _loss(router, x, batch_shape):
    out = router(x, batch_shape)
    return sum(out.losses.values()), out.counts_E


def _on_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    router = _router()
    router.reduce_counts = MicroBatchCountReducer(dist.group.WORLD)
    x = _tokens().chunk(world)[rank]
    loss, counts = _loss(router, x, (1, x.shape[0]))
    loss.backward()
    return loss.detach(), counts, router.weight.grad


@pytest.mark.dist
def test_split_micro_batch_losses_add_up():
    router = _router()
    ref_loss, ref_counts = _loss(router, _tokens(), (1, T))
    ref_loss.backward()
    results = run_ranks(_on_rank, 2)
    torch.testing.assert_close(sum(r[0] for r in results), ref_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sum(r[2] for r in results), router.weight.grad, rtol=1e-5, atol=1e-7)
    for _, counts, _ in results:
        assert torch.equal(counts, ref_counts)  # every rank sees the micro-batch-wide counts
