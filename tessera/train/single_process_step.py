"""Forward/backward of one global batch in one process: micro-batches accumulated in order.

This is the reference every parallel layout is measured against (DESIGN.md, numerics contract),
so its arithmetic is kept exactly as it is: a change here changes every run's losses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tessera.data.batching import Batch
from tessera.train.loss import count_loss_tokens, micro_batch_objective, token_loss_sum


class SingleProcessStep:
    """The step engine of a one-process run (see parallel_step.py for the interface)."""

    def __init__(self, model: nn.Module, micro_batch_size: int, accumulation: int, device: torch.device,
                 autocast_dtype: torch.dtype | None):
        self.parts = [model]
        self.model, self.mb, self.accumulation = model, micro_batch_size, accumulation
        self.device, self.autocast_dtype = device, autocast_dtype

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def forward_backward(self, batch: Batch) -> dict[str, Any]:
        """Accumulate the gradient of one global batch; return its loss statistics."""
        inputs, targets, mask = batch.inputs, batch.targets, batch.target_mask
        n_loss_tokens = count_loss_tokens(targets, mask)
        mb = self.mb
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_total = torch.zeros((), dtype=torch.float64)
        aux_parts: dict[str, float] = {}
        counts: dict[int, torch.Tensor] = {}
        for i in range(self.accumulation):
            rows = slice(i * mb, (i + 1) * mb)
            x = inputs[rows].to(self.device, non_blocking=True)
            y = targets[rows].to(self.device, non_blocking=True)
            m = mask[rows].to(self.device, non_blocking=True)
            with self._autocast():
                out = self.model(x)
            micro_sum = token_loss_sum(out.logits, y, m)
            micro_batch_objective(micro_sum, out.aux_loss, n_loss_tokens, self.accumulation).backward()
            loss_sum += micro_sum.detach().double().cpu()
            aux_total += out.aux_loss.detach().double().cpu()
            for name, value in out.aux_losses.items():
                aux_parts[name] = aux_parts.get(name, 0.0) + float(value.detach()) / self.accumulation
            for layer, c in out.expert_counts.items():
                c = c.detach()
                counts[layer] = counts[layer] + c if layer in counts else c.clone()
        return {"loss": float(loss_sum) / max(n_loss_tokens, 1),
                "aux_loss": float(aux_total) / self.accumulation, "aux_parts": aux_parts, "counts": counts,
                "loss_tokens": n_loss_tokens, "tokens": int(inputs.numel())}

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf))

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        self.model.update_expert_bias(counts)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """(sum of token losses, loss tokens) over the validation batches."""
        total, n = 0.0, 0
        for batch in batches:
            for i in range(0, batch.tokens.shape[0], self.mb):
                x = batch.inputs[i:i + self.mb].to(self.device)
                y = batch.targets[i:i + self.mb].to(self.device)
                m = batch.target_mask[i:i + self.mb].to(self.device)
                with self._autocast():
                    logits = self.model(x).logits
                total += float(token_loss_sum(logits, y, m))
                n += count_loss_tokens(y, m)
        return total, n
