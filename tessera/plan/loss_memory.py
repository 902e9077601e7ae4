"""Memory at the loss: what the cross-entropy allocates on top of the tensors it saves.

With E = tokens x vocabulary / tp logits on a rank, c the bytes of a logit as the LM head makes it
(2 in bf16, 4 in fp32) and `copy` = 4 where the loss casts them to fp32 (0 when they are fp32
already), each implementation peaks at (bytes per logit, beside the 4-byte log-softmax or softmax
it saves, which the head's saved tensors count):

- "tessera", the trainer's `tessera.train.objectives.loss.token_loss_sum`, whose step keeps the logits until
  the micro-batch's backward is done (tessera/train/steps/step_engine.py):
  tp = 1, `F.cross_entropy(logits.float())`: in backward the logits (c), nll_loss's gradient (4) and
  log_softmax's gradient (4): c + 8.
  tp > 1, `tessera.parallel.vocab_parallel_loss`: in forward the logits (c), their fp32 copy, the
  shifted logits and their exponentials (4 + 4): c + copy + 8.
- "torch", what torchtitan runs: `F.cross_entropy(pred.flatten(0, 1).float(), labels)` with `pred`
  deleted before backward (torchtitan train.py):
  tp = 1: nll_loss's and log_softmax's gradients: 8.
  tp > 1, torch's `loss_parallel` (torch.distributed.tensor.parallel.loss): its backward holds
  the zero-filled gradient, exp(log-softmax) and their sum (12); its forward the logits, their
  fp32 copy and the shifted logits: max(12, c + copy + 4).

tests/plan/test_loss_memory.py measures each peak (allocations and frees recorded by torch's
profiler on CPU, real gloo ranks for tp > 1) and checks these figures.
"""

from __future__ import annotations

from tessera.config.errors import ConfigError

LOSSES = ("tessera", "torch")


def loss_buffer_bytes_per_logit(loss: str, tp: int, compute: int) -> float:
    """Bytes per local logit the loss `loss` holds at its peak beyond its saved log-softmax,
    logits included (module docstring), at tensor-parallel degree `tp` and `compute`-byte logits."""
    if loss not in LOSSES:
        raise ConfigError(f"loss={loss!r} is invalid: one of {', '.join(LOSSES)}")
    copy = 4 if compute < 4 else 0
    if loss == "tessera":
        return float(compute + 8 if tp == 1 else compute + copy + 8)
    return float(8 if tp == 1 else max(12, compute + copy + 4))
