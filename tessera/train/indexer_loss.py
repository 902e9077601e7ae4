"""train.indexer_loss on the model (tessera/config/training/indexer_loss.py): every sparse-attention
layer gets its `indexer_training` (tessera/models/attention_variants/indexer_loss.py) and its indexer's
weights require gradients; the dense warm-up freezes every other weight, so the optimizer holds the
indexers' alone. Applied to the whole model before it is cut and before the optimizers are built
(tessera.train.builder), to the meta `reference` too, so every layout trains the same weights."""

from __future__ import annotations

from torch import nn

from tessera.config.schema import RunConfig
from tessera.models.attention_variants.indexer_loss import IndexerTraining
from tessera.models.attention_variants.sparse_mla import SparseLatentAttention


def apply_indexer_loss(model: nn.Module, reference: nn.Module | None, cfg: RunConfig) -> None:
    """The indexer loss on `model` (and `reference`); a no-op without train.indexer_loss."""
    il = cfg.train.indexer_loss
    if not il.enabled:
        return
    for m in (model, reference):
        if m is not None:
            train_indexers(m, il.weight, il.stage)


def train_indexers(model: nn.Module, weight: float, stage: str) -> None:
    """Every sparse-attention layer of `model` trains its indexer by the KL of `weight` in `stage`
    (dense: every other weight of the model frozen)."""
    if stage == "dense":
        model.requires_grad_(False)
    training = IndexerTraining(weight, stage)
    for layer in model.modules():
        if isinstance(layer, SparseLatentAttention):
            layer.indexer_training = training
            layer.indexer.requires_grad_(True)
