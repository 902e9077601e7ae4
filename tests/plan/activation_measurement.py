"""Count the activation bytes of one training forward of a real `tessera.models.Transformer` on CPU.

Recomputation and offload are applied by the trainer's own code, from outside the model, exactly
as `tessera.parallel.parallelize` applies them: `apply_activation_checkpointing` (full: the block
keeps its input; selective: the attention core seam re-runs; op: the block re-runs except the
operators its save list keeps, optionally in FP8) on every `interval`-th block, then
`offload_blocks` (what the blocks save goes to a host store; on CPU the trainer itself refuses the
option, since it frees nothing there, so the test drives the same hooks directly).
The loss is `tessera.train.objectives.loss.token_loss_sum` plus the MoE auxiliary loss, as the trainer computes it.
"""

from __future__ import annotations

import torch

from tessera.config.model import ModelConfig
from tessera.config.parallel import TORCHTITAN_SAVE
from tessera.models import Transformer
from tessera.parallel.memory.activation_checkpoint import apply_activation_checkpointing
from tessera.parallel.memory.activation_offload import HostStore, offload_blocks
from tessera.plan.saved_tensors import SavedTensorCounter
from tessera.train.objectives.loss import token_loss_sum


def build_model(cfg: ModelConfig, dtype: str, recompute: str = "none", interval: int = 1, *,
                save: tuple[str, ...] = TORCHTITAN_SAVE, fp8: tuple[str, ...] = (),
                offload: HostStore | None = None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, recompute, interval, save=save, fp8=fp8)
    if offload is not None:
        offload_blocks(model, offload)
    return model


def measure_activation_bytes(cfg: ModelConfig, dtype: str, recompute: str = "none", batch: int = 2,
                             seq: int = 64, model: Transformer | None = None, **policy) -> SavedTensorCounter:
    """Forward + loss under the counter; returns it (its `total_bytes` is what backward would use).
    `model`: one `build_model(cfg, dtype, recompute, ...)` made (to watch it), else a new one built
    with `policy` (build_model's interval, save, fp8, offload)."""
    model = build_model(cfg, dtype, recompute, **policy) if model is None else model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast-bf16")
    with SavedTensorCounter(model) as counter, autocast:
        out = model(ids)
        loss = token_loss_sum(out.logits, targets) + out.aux_loss
    loss.backward()  # the graph is whole: backward runs through everything that was counted
    return counter
