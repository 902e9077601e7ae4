"""The knowledge-distillation term of the training objective (`train.distill`).

For a micro-batch of the global batch, over its loss tokens t (the tokens the data loss counts:
targets that are not IGNORE_INDEX, so under SFT the answers only) and the N loss tokens of the
whole global batch (tessera.train.objectives.loss):

    kd_sum    = T^2 * sum_t KL(p_t || q_t),   p_t = softmax(z_teacher,t / T),  q_t = softmax(z_student,t / T)
    objective = ((1 - w) * ce_sum + w * kd_sum) / N  +  aux / M

KL(p || q) = sum_v p_v (log p_v - log q_v) is the forward KL (Hinton et al. 2015, "Distilling the
Knowledge in a Neural Network"; T^2 keeps the gradient's scale independent of T). Dividing by the
global N, as the data loss is, makes accumulated micro-batches and data-parallel ranks give the
gradient of the whole global batch, so every layout trains like one process. With
`train.distill.hidden_layers` the objective also holds hidden_weight * hidden_sum / N, the
matching of chosen layers' hidden states through learned projections (hidden_match.py).

Logits sharded over the vocabulary by tensor parallelism (DTensors) are gathered whole before the
softmax: each tensor-parallel rank then computes the same KL, as the vocabulary-parallel
cross-entropy gives every rank the same loss; the gradient flows back to each rank's slice. That
holds [tokens, V] logits per rank for the KL, which the vocabulary-parallel cross-entropy avoids.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.train.objectives.hidden_match import HiddenMatch
from tessera.train.objectives.loss import IGNORE_INDEX


def kd_loss_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """T^2 * sum over the tokens whose target is not IGNORE_INDEX of KL(softmax(teacher / T) ||
    softmax(student / T)), in fp32. Logits [B, S, V] (or DTensors sharded on V), targets [B, S]."""
    if isinstance(student_logits, DTensor):
        student_logits = student_logits.full_tensor()
    if isinstance(teacher_logits, DTensor):
        teacher_logits = teacher_logits.full_tensor()
    V = student_logits.shape[-1]
    keep_N = targets.reshape(-1) != IGNORE_INDEX
    s_NV = student_logits.float().reshape(-1, V)[keep_N] / temperature
    t_NV = teacher_logits.float().reshape(-1, V)[keep_N] / temperature
    log_q_NV = torch.log_softmax(s_NV, dim=-1)
    log_p_NV = torch.log_softmax(t_NV, dim=-1)
    p_NV = log_p_NV.exp()
    # 0 * log 0 is 0: a teacher token of probability 0 (a logit of -inf) adds nothing rather than NaN
    kl = torch.where(p_NV > 0, p_NV * (log_p_NV - log_q_NV), 0.0).sum()
    return kl * (temperature * temperature)


class Distiller:
    """The frozen teacher (built and cut like the student: tessera.train.objectives.teacher; under pp an
    nn.ModuleList of this rank's teacher stages, run by the pipeline: tessera.train.steps.pipeline_step)
    and the objective that mixes its KD term with the data loss."""

    def __init__(self, teacher: nn.Module, temperature: float, weight: float,
                 hidden: HiddenMatch | None = None, hidden_weight: float = 0.0):
        self.teacher, self.temperature, self.weight = teacher, temperature, weight
        # train.distill.hidden_layers: the learned projections and block outputs (hidden_match.py)
        self.hidden, self.hidden_weight = hidden, hidden_weight
        self.optimizers = [] if hidden is None else [hidden.optimizer]  # stepped with the student's

    @torch.no_grad()
    def teacher_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The teacher's logits of a micro-batch (under the caller's autocast), with no graph."""
        return self.teacher(inputs).logits

    def kd_sum(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
        return kd_loss_sum(student_logits, teacher_logits, targets, self.temperature)

    def mix(self, ce_sum: torch.Tensor, kd_sum: torch.Tensor) -> torch.Tensor:
        """(1 - w) * ce_sum + w * kd_sum: the micro-batch's summed objective before the division by N."""
        return (1.0 - self.weight) * ce_sum + self.weight * kd_sum

    def objective(self, ce_sum: torch.Tensor, kd_sum: torch.Tensor, aux_loss: torch.Tensor,
                  global_loss_tokens: int, num_micro_batches: int,
                  hidden_sum: torch.Tensor | None = None) -> torch.Tensor:
        """This micro-batch's share of the global-batch objective (module docstring); with weight 0
        it is the data objective exactly (1.0 * ce + 0.0 * kd adds nothing in floating point).
        `hidden_sum` (hidden-state matching, hidden_match.py) adds hidden_weight * hidden_sum / N."""
        n = max(global_loss_tokens, 1)
        objective = self.mix(ce_sum, kd_sum) / n + aux_loss.float() / num_micro_batches
        return objective if hidden_sum is None else objective + self.hidden_weight * hidden_sum / n
