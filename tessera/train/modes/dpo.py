"""The DPO mode (train/modes/registry.py, `train.objective: dpo`): Direct Preference Optimization of
the `model` section's model on preference pairs (data.kind=preference, tessera.data.preference)
against a frozen reference model.

    trainer = Trainer(load_config("configs/tiny-dense.yaml", ["train.objective=dpo", "data.kind=preference",
                                  "data.datasets=[{path: prefs.jsonl}]", "train.init_from=runs/tiny-dense-hf"]))

The policy is built, cut by the layout and started as any run's model (tessera.train.builder: from
`train.init_from`, or from `train.seed`). The reference is the run's initial weights, built again
beside it and frozen (`build_frozen_model` of train.init_from, or of the seed: under dp_shard
sharded by FSDP as the policy is) and run forward under no_grad, so a resumed run compares with the
same reference as the straight one. A global batch holds `train.global_batch_size` pairs; each rank
takes its rows (its pairs) and runs them `train.micro_batch_size` pairs at a time, the chosen and
rejected sequences of a micro-batch in one forward of each model. With B the pairs of the global
batch and M its micro-batches over all ranks, every micro-batch backpropagates

    sum over its pairs of loss_pair / B  +  aux / M

(tessera.train.objectives.preference_loss: the pair's loss from the answers' summed log-probabilities;
aux: an MoE policy's balancing losses), so each data-parallel layout accumulates the one-process
gradient, which the loop clips and AdamW applies as for any run. metrics.jsonl logs, besides an
ordinary step's figures (metric_record.py), `loss` (the mean DPO loss of the pairs) and the
rewards (beta x log-ratio against the reference) averaged over the pairs: `rewards/chosen`,
`rewards/rejected`, `rewards/margin` (chosen - rejected) and `rewards/accuracy` (the fraction of
pairs whose chosen reward is the higher), and `logps/chosen`, `logps/rejected` (the policy's summed
answer log-probabilities); `loss_tokens` counts the answers' tokens. There is no evaluation.
Checkpoints, resuming and `checkpoint.export_hf` are a language-model run's (train/modes/lm.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from tessera.config.errors import ConfigError, TrainingError
from tessera.config.schema import RunConfig
from tessera.data.batching import Batch
from tessera.models.model_input import ModelInput
from tessera.parallel import dp_rows, global_sum
from tessera.train.builder import TrainingParts, build_frozen_model, build_training_parts
from tessera.train.modes.lm import export_hf, lm_closing, lm_summary
from tessera.train.modes.mode import ModeContext, ModeParts
from tessera.train.objectives.loss import masked_targets
from tessera.train.objectives.preference_loss import answer_logps, pair_scores
from tessera.train.results import StepResult
from tessera.train.run.layout import RunLayout
from tessera.train.run.metric_record import step_record
from tessera.train.steps.step_engine import (
    clip_parts_grad_norm,
    mixed_precision,
    sync_gradients,
    update_parts_expert_bias,
)
from tessera.train.steps.step_stats import StepStats, reduce_over_ranks

# the sums a rank keeps over its pairs, in this order (`DPOStep.forward_backward` divides them)
SUMS = ("loss", "rewards/chosen", "rewards/rejected", "correct", "logps/chosen", "logps/rejected", "answer_tokens")


class DPOStep:
    """The `StepEngine` of a DPO run: the policy (its one part) and the frozen reference, in one
    process or under dp_replicate / dp_shard / the distributed optimizer (module docstring)."""

    def __init__(self, cfg: RunConfig, layout: RunLayout, built: TrainingParts, reference: nn.Module):
        self.parts = built.parts
        self.model, self.reference = built.parts[0], reference
        self.dims, self.device = layout.dims, layout.device
        self.mb, self.autocast = cfg.train.micro_batch_size, built.autocast_dtype
        self.beta, self.loss = cfg.train.dpo.beta, cfg.train.dpo.loss
        self.distributed_optimizers = built.distributed_optimizers  # parallel.optimizer=distributed

    def _rows(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's pairs of the global batch: tokens and loss mask, [b, 2, seq_len + 1] each."""
        if self.dims is None:
            return batch.tokens, batch.loss_mask
        rows = dp_rows(batch.tokens.shape[0], self.dims)
        return batch.tokens[rows], batch.loss_mask[rows]

    def _sync_gradients(self, last_micro_batch: bool) -> None:
        """Reduce gradients over the data-parallel ranks in the backward of the rank's last micro-batch only."""
        sync_gradients(self.model, self.distributed_optimizers, last_micro_batch)

    def _micro_batch(self, tokens: torch.Tensor, mask: torch.Tensor, pairs: int, micro_batches: int,
                     stats: StepStats) -> torch.Tensor:
        """Forward of both models and backward of the policy on a micro-batch of pairs; its `SUMS` (fp64)."""
        seqs, seq_mask = tokens.flatten(0, 1), mask.flatten(0, 1)  # rows 2i: chosen, 2i + 1: rejected
        x = seqs[:, :-1].to(self.device)
        y = masked_targets(seqs[:, 1:], seq_mask[:, 1:]).to(self.device)
        with torch.no_grad(), mixed_precision(self.device, self.autocast):
            ref_logits = self.reference(ModelInput(tokens=x)).logits
        ref_logps, _ = answer_logps(ref_logits, y)
        del ref_logits
        with mixed_precision(self.device, self.autocast):
            out = self.model(ModelInput(tokens=x))
        logps, counts = answer_logps(out.logits, y)
        scores = pair_scores(logps[0::2], logps[1::2], ref_logps[0::2], ref_logps[1::2], self.beta, self.loss,
                             counts[0::2], counts[1::2])
        (scores.losses.sum() / pairs + out.aux_loss.float() / micro_batches).backward()
        stats.add_routing(out)
        policy = logps.detach()
        sums = (scores.losses.detach().sum(), scores.chosen_rewards.sum(), scores.rejected_rewards.sum(),
                (scores.chosen_rewards > scores.rejected_rewards).sum(), policy[0::2].sum(), policy[1::2].sum(),
                counts.sum())
        return torch.stack([s.double() for s in sums])

    def forward_backward(self, batch: Batch) -> StepResult:
        """The policy's gradient of the global batch's mean DPO loss (summed over the ranks); the
        step's loss, rewards and log-probabilities averaged over its pairs (`scalars`)."""
        tokens, mask = self._rows(batch)
        pairs = batch.tokens.shape[0]
        local = tokens.shape[0] // self.mb
        micro_batches = local * (self.dims.dp_size if self.dims is not None else 1)
        sums = torch.zeros(len(SUMS), dtype=torch.float64, device=self.device)
        stats = StepStats()
        for i in range(local):
            self._sync_gradients(i == local - 1)
            rows = slice(i * self.mb, (i + 1) * self.mb)
            sums += self._micro_batch(tokens[rows], mask[rows], pairs, micro_batches, stats)
        sums = sums.cpu() if self.dims is None else global_sum(sums.cpu(), self.dims)
        stats = reduce_over_ranks(stats, self.dims)
        means = dict(zip(SUMS, (sums / pairs).tolist()))
        scalars = {key: means[key] for key in ("rewards/chosen", "rewards/rejected")}
        scalars.update({"rewards/margin": scalars["rewards/chosen"] - scalars["rewards/rejected"],
                        "rewards/accuracy": means["correct"], "logps/chosen": means["logps/chosen"],
                        "logps/rejected": means["logps/rejected"]})
        return StepResult(loss=means["loss"], tokens=int(batch.tokens[..., :-1].numel()),
                          loss_tokens=int(sums[SUMS.index("answer_tokens")]), aux_loss=stats.aux_total / micro_batches,
                          aux_parts={k: v / micro_batches for k, v in stats.aux_parts.items()}, counts=stats.counts,
                          scalars=scalars)

    def clip_grad_norm(self, max_norm: float) -> float:
        """The policy's whole gradient norm, clipped (every rank the same)."""
        return clip_parts_grad_norm(self.parts, max_norm, self.dims,
                                    distributed_optimizers=self.distributed_optimizers)

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        update_parts_expert_bias(self.parts, counts, self.device)

    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        raise TrainingError("a DPO run has no validation loss: its rewards/* figures in metrics.jsonl measure it, "
                            "and its mode does not evaluate (train.eval_interval must be 0)")


def build_dpo_mode(ctx: ModeContext) -> ModeParts:
    """The policy (the run's model, its optimizer), the frozen reference and their step engine, once
    the data's tokenizer fits the model."""
    cfg, layout = ctx.cfg, ctx.layout
    if ctx.data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is invalid: the tokenizer has "
                          f"{ctx.data.vocab_size} tokens, so it must be >= {ctx.data.vocab_size}")
    built = build_training_parts(cfg, layout, ctx.init_from, ctx.compile)
    with layout.phase("building the DPO reference model"):
        reference = build_frozen_model(cfg, layout, cfg.train.init_from)  # the initial weights, also on resume
    return ModeParts(
        engine=DPOStep(cfg, layout, built, reference), optimizers=built.optimizers, full_shapes=built.full_shapes,
        record=partial(step_record, moe=cfg.model.is_moe), summary=partial(_summary, cfg, layout),
        closing=partial(lm_closing, cfg), finish=partial(export_hf, cfg, layout), label="dpo", evaluates=False,
        init_from=ctx.init_from, init_bytes_read=built.init_bytes_read, fp8_layers=built.fp8_layers)


def _summary(cfg: RunConfig, layout: RunLayout, start_step: int) -> list[str]:
    """A language-model run's lines, and what DPO compares against."""
    d = cfg.train.dpo
    start = f"train.init_from {cfg.train.init_from}" if cfg.train.init_from else f"train.seed={cfg.train.seed}"
    return lm_summary(cfg, layout, start_step) + [
        f"objective: DPO, {d.loss} loss, beta {d.beta:g}, against a frozen reference: the initial weights ({start}); "
        "metrics rewards/chosen, rewards/rejected, rewards/margin, rewards/accuracy"]
