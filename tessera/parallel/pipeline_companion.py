"""A frozen companion model run stage by stage beside a pipelined model (the distillation teacher
under pp > 1: tessera.train.steps.pipeline_step).

The companion is cut by the same layout: its layers split over the same S = pp x vpp stages
(`stage_layer_ids` of its own depth), each of this rank's stages held beside the trained model's
stage of the same index. Their activations travel through the pipeline together, so no stage
needs anything the schedule does not already send (only the first stage sees token ids; the
last sees hidden states and the targets):

    first stage   token ids        -> both stages -> cat([h_BSD, c_BSC], -1)        sent on
    middle stage  [B, S, D + C]    -> split       -> cat([h_BSD, c_BSC], -1)        sent on
    last stage    [B, S, D + C]    -> split       -> (logits, companion logits)     to the loss

One tensor travels between stages, so the schedule's sends, shape inference and backward are
those of a plain stage. The companion runs under no_grad: the gradient that comes back for its
half of the tensor is zero and is dropped by the concatenation's backward. Its half travels in
the trained model's activation dtype (the trained stages' numerics never change; under bf16
autocast the residual streams of both are fp32 anyway). Under sequence or context parallelism
both halves are this rank's sequence slice, the companion cut like the trained model.

The split and the join are a forward pre-hook and a forward hook on the trained stage module,
registered after those `split_stage` installs, so the split sees the stage's `ModelInput` and the
join the stage's tensor output; the companion stage is handed its own `ModelInput`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tessera.models.model_input import ModelInput


class CompanionStage:
    """The hooks that run `companion` (one frozen stage) beside a trained stage of hidden size `dim`."""

    def __init__(self, companion: nn.Module, dim: int, last: bool):
        self.companion, self.dim, self.last = companion, dim, last
        self._pending: ModelInput | None = None  # the companion's input, between the two hooks

    def split_input(self, module: nn.Module, args: tuple[ModelInput]) -> tuple | None:
        inp = args[0]
        if inp.hidden is None:  # token ids: the first stage feeds both models the same ones
            self._pending = ModelInput(tokens=inp.tokens)
            return None
        self._pending = ModelInput(hidden=inp.hidden[..., self.dim:].detach())
        return (replace(inp, hidden=inp.hidden[..., :self.dim]), *args[1:])

    def join_output(self, module: nn.Module, args: tuple, out: torch.Tensor) -> object:
        x, self._pending = self._pending, None
        with torch.no_grad():
            c = self.companion(x)
        if self.last:  # logits of both: the schedule hands the pair to its loss function
            return out, c
        return torch.cat([out, c.to(out.dtype)], dim=-1)


def attach_companion(stage: nn.Module, companion: nn.Module, dim: int, last: bool) -> CompanionStage:
    """Run `companion` beside the trained `stage` (a `split_stage` module, hooks already in place)."""
    hooks = CompanionStage(companion, dim, last)
    stage.register_forward_pre_hook(hooks.split_input)
    stage.register_forward_hook(hooks.join_output)
    return hooks
