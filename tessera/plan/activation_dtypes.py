"""Activation dtypes: the bytes per element of what a forward pass computes, keeps and multiplies.

One table for every planner estimate that counts activation bytes: the saved tensors
(saved/activation_terms.py), the time model's memory-bound work (op_time.py) and the collectives that
move activations (comm.py). Three precisions: fp32; bf16 (weights and activations bf16, as FSDP2's
mixed precision runs a model); autocast-bf16 (fp32 weights under torch.autocast, the trainer's
`train.dtype: bf16`: linear layers compute in bf16, the residual stream stays fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.choices import lookup_choice


@dataclass(frozen=True)
class ActivationDtype:
    name: str
    compute: int  # bytes of a linear layer's output
    residual: int  # bytes of the residual stream (embedding output, block outputs)
    weight: int  # bytes of a weight as the forward multiplies it (norm gains promote with it)
    autocast: bool


ACTIVATION_DTYPES = {
    "fp32": ActivationDtype("fp32", 4, 4, 4, False),
    "bf16": ActivationDtype("bf16", 2, 2, 2, False),
    "autocast-bf16": ActivationDtype("autocast-bf16", 2, 4, 4, True),
}


def get_activation_dtype(name: str) -> ActivationDtype:
    return lookup_choice(ACTIVATION_DTYPES, name, "activation_dtype")
