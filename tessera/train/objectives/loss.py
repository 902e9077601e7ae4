"""The training objective, normalised over the whole global batch.

For a global batch split into micro-batches m (over accumulation steps and data-parallel ranks):

    loss = sum_m sum_{t in m, mask_t} CE_t / N  +  (1/M) sum_m aux_m

where N is the number of loss tokens in the whole global batch and M the number of micro-batches.
Dividing each micro-batch's token sum by the global N (not by its own count) makes the gradient
of accumulated micro-batches equal to the gradient of one big batch, whatever the number of loss
tokens each micro-batch holds (SFT masks make them differ). A mean of per-micro-batch means
would weight a token of a short micro-batch more than one of a long one. The MoE auxiliary
losses are defined per micro-batch over its own tokens (docs/architecture.md, "Numerics contract") and
averaged over micro-batches.

`token_loss_sum` is the one token-loss function of every engine and layout: on logits sharded
over the vocabulary by tensor parallelism (a DTensor) it runs the vocabulary-parallel
cross-entropy of `tessera.parallel.vocab_parallel_loss`, which also owns IGNORE_INDEX.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tessera.parallel.vocab_parallel_loss import IGNORE_INDEX, vocab_parallel_loss_sum, vocab_parallel_token_losses

__all__ = ["IGNORE_INDEX", "count_loss_tokens", "masked_targets", "micro_batch_objective", "token_logps",
           "token_loss_sum"]


def masked_targets(targets: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Targets with the positions outside the loss mask replaced by IGNORE_INDEX."""
    if loss_mask is None:
        return targets
    return targets.masked_fill(~loss_mask.bool(), IGNORE_INDEX)


def count_loss_tokens(targets: torch.Tensor, loss_mask: torch.Tensor | None = None) -> int:
    """Number of target positions that contribute to the loss."""
    return int(targets.numel() if loss_mask is None else loss_mask.bool().sum().item())


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Sum of next-token cross-entropies over the loss tokens, computed in fp32.

    logits [B, S, V] (any float dtype; or a DTensor sharded on V over a one-dimensional
    tensor-parallel mesh, what `parallelize` makes of the LM head), targets [B, S] token ids
    (IGNORE_INDEX: no loss), loss_mask [B, S] (1 = counts; None: every target that is not ignored).
    """
    targets = masked_targets(targets, loss_mask)
    if isinstance(logits, DTensor):
        return vocab_parallel_loss_sum(logits, targets)
    V = logits.shape[-1]
    return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 [B, S] log-probability of each target token under `logits` [B, S, V], 0 where the target
    is IGNORE_INDEX: what DPO sums over an answer and a policy gradient weighs. Logits sharded on
    the vocabulary by tensor parallelism (a DTensor) go through the vocabulary-parallel cross-entropy,
    never gathered."""
    if isinstance(logits, DTensor):
        return -vocab_parallel_token_losses(logits.float(), targets)
    B, S, V = logits.shape
    return -F.cross_entropy(logits.float().reshape(B * S, V), targets.reshape(B * S), ignore_index=IGNORE_INDEX,
                            reduction="none").view(B, S)


def micro_batch_objective(loss_sum: torch.Tensor, aux_loss: torch.Tensor, global_loss_tokens: int,
                          num_micro_batches: int) -> torch.Tensor:
    """This micro-batch's share of the global-batch loss; backward of each share accumulates the
    gradient of the whole global batch's loss."""
    return loss_sum / max(global_loss_tokens, 1) + aux_loss.float() / num_micro_batches
