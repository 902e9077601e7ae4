"""Count the activation bytes of one training forward of a real `tessera.models.Transformer` on CPU.

Recomputation is applied the way a trainer applies it, from outside the model:
- full: every decoder block runs under `torch.utils.checkpoint` (non-reentrant), so only its
  inputs are kept;
- selective: every call of `F.scaled_dot_product_attention` (the attention core) runs under
  checkpoint, through a TorchFunctionMode that reroutes it.
The loss is `tessera.train.loss.token_loss_sum` plus the MoE auxiliary loss, as the trainer computes it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from tessera.config.model import ModelConfig
from tessera.models import Transformer
from tessera.plan.saved_tensors import SavedTensorCounter
from tessera.train.loss import token_loss_sum


class CheckpointedBlock(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


class RecomputeAttentionCore(TorchFunctionMode):
    """Runs SDPA under activation checkpointing: Korthikanti's selective recomputation."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return checkpoint(lambda *a: func(*a, **kwargs), *args, use_reentrant=False)
        return func(*args, **kwargs)


def build_model(cfg: ModelConfig, dtype: str, recompute: str = "none") -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    if recompute == "full":
        for key in list(model.layers.keys()):
            model.layers[key] = CheckpointedBlock(model.layers[key])
    return model


def measure_activation_bytes(cfg: ModelConfig, dtype: str, recompute: str = "none", batch: int = 2,
                             seq: int = 64, model: Transformer | None = None) -> SavedTensorCounter:
    """Forward + loss under the counter; returns it (its `total_bytes` is what backward would use).
    `model`: one `build_model(cfg, dtype, recompute)` made (to watch it), else a new one."""
    model = build_model(cfg, dtype, recompute) if model is None else model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast-bf16")
    selective = RecomputeAttentionCore() if recompute == "selective" else contextlib.nullcontext()
    with SavedTensorCounter(model) as counter, autocast, selective:
        out = model(ids)
        loss = token_loss_sum(out.logits, targets) + out.aux_loss
    loss.backward()  # the graph is whole: backward runs through everything that was counted
    return counter
