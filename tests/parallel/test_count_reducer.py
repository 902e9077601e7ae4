"""Router balancing losses stay micro-batch-wide when a micro-batch's tokens are spread over
ranks (as context parallelism spreads them): with `MicroBatchCountReducer` (routing counts, also
per sequence for the sequence-level loss) and `MicroBatchTokenReducer` (Sinkhorn's column sums)
the ranks' choices are the single-process ones, and their losses and router gradients add up to
the single-process ones."""

import pytest
import torch
import torch.distributed as dist

from tessera.config.model import MoEConfig
from tessera.models.moe import Router
from tessera.parallel.context_parallel_moe import MicroBatchTokenReducer
from tessera.parallel.expert_parallel import MicroBatchCountReducer
from tests.forked_ranks import run_ranks

D, B, S = 16, 2, 6
CFGS = {
    "switch": MoEConfig(num_experts=4, top_k=2, ffn_dim=8, aux_loss_coef=0.1, z_loss_coef=0.01),
    "sequence": MoEConfig(num_experts=4, top_k=2, ffn_dim=8, seq_aux_loss_coef=0.1, z_loss_coef=0.01),
    "sinkhorn": MoEConfig(num_experts=4, top_k=2, ffn_dim=8, aux_loss_coef=0.1, sinkhorn=True),
}


def _router(name: str) -> Router:
    router = Router(D, CFGS[name])
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(5)))
    return router


def _tokens() -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(6))


def _route(router, x_BSD):
    out = router(x_BSD.reshape(-1, D), tuple(x_BSD.shape[:2]))
    return sum(out.losses.values()), out.counts_E, out.indices_Tk.view(x_BSD.shape[0], x_BSD.shape[1], -1)


def _on_rank(name: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    router = _router(name)
    router.reduce_counts = MicroBatchCountReducer(dist.group.WORLD)
    router.reduce_over_tokens = MicroBatchTokenReducer(dist.group.WORLD)
    loss, counts, idx = _route(router, _tokens().chunk(world, dim=1)[rank])  # this rank's chunk of each sequence
    loss.backward()
    return loss.detach(), counts, router.weight.grad, idx


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(CFGS))
def test_split_micro_batch_losses_add_up(name):
    router = _router(name)
    ref_loss, ref_counts, ref_idx = _route(router, _tokens())
    ref_loss.backward()
    results = run_ranks(_on_rank, 2, name)
    assert torch.equal(torch.cat([r[3] for r in results], dim=1), ref_idx)  # the same experts chosen
    torch.testing.assert_close(sum(r[0] for r in results), ref_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sum(r[2] for r in results), router.weight.grad, rtol=1e-5, atol=1e-7)
    for _, counts, _, _ in results:
        assert torch.equal(counts, ref_counts)  # every rank sees the micro-batch-wide counts
