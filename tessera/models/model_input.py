"""What a decoder's `forward` reads (`Transformer.forward`): one typed input instead of keyword modes.

    out = model(ids)                                                   # token ids [B, S]: the shorthand
    out = model(ModelInput(tokens=ids, targets=targets))               # training: the loss of targets
    out = model(ModelInput(tokens=ids, positions=pos, cache=cache))    # serving: a prompt chunk or decode step
    out = model(ModelInput(hidden=h_BSD))                              # a later pipeline stage

The sequence enters either as token ids, which the model embeds, or as hidden states, which go to
its first layer as they are: a later pipeline stage's input (under sequence parallelism this rank's
1/tp of the sequence), or the embeddings a vision-language model merged its images into. Which one
is said by the field, never guessed from a tensor's dtype. The other fields are what the call
computes besides logits; each is described where `Transformer.forward` reads it.

A `ModelInput` is a pytree node (torch.utils._pytree): what walks a module's arguments (FSDP's input
casting and its backward hooks) reaches the tensors inside it as it would reach them passed alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree

from tessera.config.errors import ModelError
from tessera.models.attention import AttentionCache


@dataclass
class ModelInput:
    tokens: torch.Tensor | None = None  # [B, S] token ids, embedded by the model
    hidden: torch.Tensor | None = None  # [B, S, D] hidden states entering the first layer (instead of tokens)
    positions: torch.Tensor | None = None  # [B, S] (M-RoPE: [3, B, S]); None: the model's `position_source`
    cache: AttentionCache | None = None  # where attention reads and writes keys and values (serving)
    targets: torch.Tensor | None = None  # [B, S] next-token ids (IGNORE_INDEX: no loss)
    # multi-token prediction: the sequence's token ids and targets where the input is hidden states
    # (a pipeline's last stage; default: `tokens` and `targets`), and N, the divisor of its objective
    mtp_inputs: torch.Tensor | None = None
    mtp_targets: torch.Tensor | None = None
    mtp_divisor: float | None = None
    keep_layers: tuple[int, ...] = ()  # block counts whose residual stream is also returned (`kept_hidden`)
    logit_positions: torch.Tensor | None = None  # [R] or [B, R] sequence indices: the logits of those rows only

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.hidden is None):
            raise ModelError("a ModelInput holds the sequence once: tokens=[B, S] token ids or hidden=[B, S, D] "
                             "hidden states, not " + ("both" if self.tokens is not None else "neither"))
        if self.tokens is not None and self.tokens.is_floating_point():
            raise ModelError(f"ModelInput.tokens are token ids, not {self.tokens.dtype} values: hidden states "
                             "entering the first layer go in ModelInput(hidden=...)")

    @classmethod
    def of(cls, x: ModelInput | torch.Tensor) -> ModelInput:
        """`x` itself, or token ids [B, S] given alone as the input of token ids and nothing else."""
        return x if isinstance(x, ModelInput) else cls(tokens=x)

    @property
    def sequence(self) -> torch.Tensor:
        """The tensor that carries the sequence: the token ids or the hidden states."""
        return self.tokens if self.tokens is not None else self.hidden


_pytree.register_dataclass(ModelInput)
