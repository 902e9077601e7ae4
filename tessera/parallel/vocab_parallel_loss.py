"""Cross-entropy on vocabulary-sharded logits, without ever materialising full-vocabulary logits
on one rank (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019, section 3).

Rank r holds logits z[:, v] for v in its slice [r V/tp, (r+1) V/tp). Per token:

    m   = max_v z_v                    (all-reduce MAX of the local maxima)
    s   = sum_v exp(z_v - m)           (all-reduce SUM)
    z_y = the target's logit           (all-reduce SUM; only the owning rank contributes)
    CE  = log s - (z_y - m)
    dCE/dz_v = softmax_v - [v == y]    (computed on the local slice only)

`vocab_parallel_loss_sum` takes the model's logits as a DTensor sharded on the vocabulary and
returns the sum of the token losses in fp32 (targets equal to IGNORE_INDEX count none). The
training loss, `tessera.train.objectives.loss.token_loss_sum`, calls it for such logits: it is the one loss
function of every layout, and this is its tensor-parallel implementation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from tessera.config.errors import ParallelError

IGNORE_INDEX = -100  # the target of a position that counts no loss (as torch's cross_entropy default)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, targets_N, vocab_start, group):
        logits_NV = logits_NV.float()
        V_local = logits_NV.shape[-1]
        m = logits_NV.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits_NV - m[:, None]
        exp = shifted.exp()
        s = exp.sum(dim=-1)
        dist.all_reduce(s, group=group)
        local_t = targets_N - vocab_start
        here = (local_t >= 0) & (local_t < V_local)
        local_t = torch.where(here, local_t, torch.zeros_like(local_t))
        target_logit = shifted.gather(1, local_t[:, None]).squeeze(1) * here
        dist.all_reduce(target_logit, group=group)
        valid = targets_N != IGNORE_INDEX
        loss = (s.log() - target_logit) * valid
        ctx.save_for_backward(exp / s[:, None], local_t, here & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_N):
        softmax, local_t, hit, valid = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.nonzero(hit).squeeze(1)
        grad[rows, local_t[rows]] -= 1.0
        grad *= (grad_N * valid)[:, None]
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor, vocab_start: int,
                                 group: ProcessGroup) -> torch.Tensor:
    """Per-token cross-entropy [N] from this rank's vocabulary slice (0 where the target is IGNORE_INDEX)."""
    return _VocabParallelCrossEntropy.apply(logits_NV, targets_N, vocab_start, group)


def vocab_parallel_loss_sum(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the targets that are not IGNORE_INDEX, fp32.

    logits [B, S, V]: a DTensor sharded on V over a one-dimensional tensor-parallel mesh (what
    `parallelize` makes of the LM head); targets [B, S] ids.
    """
    return vocab_parallel_token_losses(logits, targets).sum()


def vocab_parallel_token_losses(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's cross-entropy, fp32, shaped as `targets` (0 where it is IGNORE_INDEX), from
    logits sharded on the vocabulary as `vocab_parallel_loss_sum` takes them: minus the target's
    log-probability, which DPO and GRPO read per token (tessera.train.objectives.loss.token_logps)."""
    targets_N = targets.reshape(-1)
    placements = logits.placements
    if logits.device_mesh.ndim != 1 or not (placements[0].is_shard() and
                                             placements[0].dim in (-1, logits.ndim - 1)):
        raise ParallelError(f"the vocabulary-parallel loss expects logits sharded on the vocabulary over one "
                            f"mesh dim, got placements {placements} on a {logits.device_mesh.ndim}-D mesh")
    mesh = logits.device_mesh
    V = logits.shape[-1]
    V_local = V // mesh.size()
    local = logits.to_local()
    vocab_start = mesh.get_local_rank() * V_local
    if local.shape[-1] != V_local:
        raise ParallelError(f"vocabulary {V} is not evenly split over tp={mesh.size()}")
    per_token = vocab_parallel_cross_entropy(local.reshape(-1, V_local), targets_N, vocab_start,
                                             mesh.get_group())
    return per_token.view(targets.shape)
