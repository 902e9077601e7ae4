"""DeepSeek-V3.2's training objective for the lightning indexer (DeepSeek-V3.2 report, section 2.1,
"Continued pre-training"): the indexer learns to score keys as the main attention weighs them.

For query t, the target p[t] is the main attention's distribution over keys summed over its heads and
L1-normalised; the indexer's distribution is softmax(I[t]) of its scores (sparse_mla.py). The loss of a
query is KL(p[t] || softmax(I[t])):

- dense warm-up (`stage="dense"`): the layer attends to every causal key and the KL runs over all of
  them; the run freezes every weight but the indexer's (tessera.train.indexer_loss);
- sparse training (`stage="sparse"`): the layer attends to the keys the indexer chose, S_t, and the KL
  runs over those only, both distributions renormalised over S_t.

The indexer's inputs (the hidden states and the query latent) are detached and the target is computed
without gradient, so this loss trains the indexer alone and the language-model loss never reaches it.
A layer's loss is `weight` x the mean over the micro-batch's queries of their KL; it travels as an
auxiliary loss of the block (`AttentionLosses`, named "indexer_kl", ModelOutput.aux_losses
"layer{i}/indexer_kl") and the objective adds it as it adds the MoE balancing losses, per micro-batch.

The target's sum over heads is a seam, `HeadSum` (`all_heads_summed` on one process): under tensor
parallelism each rank holds some of the heads and the sum must cover all of them.
Shapes: B batch, H heads, S queries, T keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

LOSS_NAME = "indexer_kl"

# [B, S, T] fp32 attention weights summed over this process's heads -> summed over all heads
HeadSum = Callable[[torch.Tensor], torch.Tensor]


def all_heads_summed(weights_BST: torch.Tensor) -> torch.Tensor:
    """The `HeadSum` of one process: every head is here."""
    return weights_BST


@dataclass(frozen=True)
class IndexerTraining:
    """What a sparse-attention layer does in training with the indexer loss (module docstring)."""

    weight: float
    stage: str  # dense | sparse (tessera.config.training.indexer_loss.INDEXER_STAGES)


@dataclass
class AttentionLosses:
    """A token mixer's auxiliary losses for its block to hand on (the MoE router's travel in its
    RouterOutput, which this joins when the block has both)."""

    losses: dict[str, torch.Tensor]


# a pytree node, as RouterOutput is: code that walks a module's outputs (FSDP2's hooks) finds the tensors
torch.export.register_dataclass(AttentionLosses, serialized_type_name="tessera.AttentionLosses")


@torch.no_grad()
def attention_target(q_BHSD: torch.Tensor, k_BHTD: torch.Tensor, scale: float, allowed_BST: torch.Tensor,
                     head_sum: HeadSum = all_heads_summed) -> torch.Tensor:
    """p [B, S, T] fp32: the main attention's weights over the allowed keys, summed over the heads and
    L1-normalised per query; no gradient."""
    logits = torch.matmul(q_BHSD.float(), k_BHTD.float().transpose(-1, -2)) * scale
    weights = logits.masked_fill(~allowed_BST[:, None], float("-inf")).softmax(dim=-1)
    summed = head_sum(weights.sum(dim=1))
    return summed / summed.sum(dim=-1, keepdim=True)


def indexer_kl(target_BST: torch.Tensor, scores_BST: torch.Tensor, allowed_BST: torch.Tensor) -> torch.Tensor:
    """[B, S]: KL(target || softmax(scores over the allowed keys)) per query, differentiable in the scores."""
    log_q = scores_BST.float().masked_fill(~allowed_BST, float("-inf")).log_softmax(dim=-1)
    log_q = log_q.masked_fill(~allowed_BST, 0.0)
    return (torch.xlogy(target_BST, target_BST) - target_BST * log_q).sum(dim=-1)


def with_attention_losses(route, losses: AttentionLosses | None):
    """A block's side output: its router's (or None), joined by its token mixer's losses."""
    if losses is None:
        return route
    if route is None:
        return losses
    return replace(route, losses={**route.losses, **losses.losses})
