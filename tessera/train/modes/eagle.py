"""The EAGLE mode (train/modes/registry.py, `train.eagle.target`): an EAGLE-3 draft head (tessera.models.eagle)
trained against a frozen target by the one training loop, written as an EAGLE-3 directory
(tessera.checkpoint.eagle_dir) at the end of the run.

    trainer = Trainer(load_config("configs/tiny-dense.yaml", ["train.eagle.target=runs/tiny-dense"]))
    result = trainer.train()        # result.written: run_dir/draft, config.json + model.safetensors

The run's `model` section is the target's (`configure_eagle`): the layout and the data are the
target's. The target is read from its directory and cut by the run's layout as a distillation
teacher is (tessera.train.builder.build_frozen_model: under dp_shard its weights sharded by FSDP),
frozen, and run forward under no_grad on every micro-batch, keeping its residual stream after block
0 (the token embeddings) and after each of the draft's feature layers (`ModelInput.keep_layers`),
and its logits. The draft then runs `unroll` steps of training-time test over the micro-batch
(`unrolled_outputs`) with the embedding of token i+1 at position i, and each step j is scored at
the positions i >= j whose token i+2 is a loss token of the data: the cross-entropy of the draft's
distribution against the target's own next-token distribution there (its softmax at position
i+1), EAGLE-3's objective. With N_j the scored positions of step j over the whole global batch and
J = unroll,

    loss = (1 / J) sum_j sum_i CE_j,i / N_j

so every data-parallel layout computes the one-process gradient: each rank holds the whole draft,
backpropagates its rows' share and the gradients are summed over the ranks (`EagleStep`, the
mode's step engine) before the loop clips them at `train.grad_clip` and AdamW steps (`optim`, the
schedule over `train.steps`). metrics.jsonl logs `loss`, `lr`, `grad_norm`, `eagle_loss/{j}`
(sum_i CE_j,i / N_j), `eagle_kl/{j}` (the same less the target's entropy: KL(target || draft),
what the draft can still lower), `eagle_acc/{j}` (the fraction of scored positions where the
draft's argmax is the target's: what greedy verification accepts) and `tokens_per_s`
(`eagle_record`). There is no evaluation.

The draft starts from `train.seed` (by parameter name, tessera.models.eagle), its head and final
norm copied from the target's (the same width: a draft that starts out predicting what the target's
last layer would from its own state). With `train.eagle.draft_vocab_size` N the draft predicts over
the N target tokens most frequent in the data (EAGLE-3's reduced vocabulary, saved as d2t): its head
starts from those rows, the target's distribution is taken over them (renormalised), and
`eagle_acc` compares the drafted target token with the target's argmax over its whole vocabulary.
Checkpoints are an ordinary run's (train_checkpoint.py) with the draft as the model: every
`checkpoint.interval` steps, at the last step and on a stop signal, run_dir/checkpoints holds the
draft, its AdamW state, the step, the schedule and the data position. `resume=True` (`tessera
train --resume`) continues from the newest good one, bit for bit as the uninterrupted run would
(the target is frozen and read again from its directory); without it a run_dir that holds
checkpoints is refused, as for any run. The EAGLE-3 directory is written at the end, the mode's
end-of-run hook (a run stopped early writes it at the step reached).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from tessera.checkpoint.eagle_dir import save_eagle_draft
from tessera.config.errors import ConfigError, TrainingError
from tessera.config.model import ModelConfig
from tessera.config.schema import RunConfig
from tessera.config.training.eagle import VOCAB_SAMPLE_BATCHES
from tessera.data.batching import Batch
from tessera.models.eagle import EagleDraft, default_feature_layers, draft_layer_config, unrolled_outputs
from tessera.models.model_input import ModelInput
from tessera.parallel import global_sum, shard_global_batch, token_dim
from tessera.train.builder import build_frozen_model
from tessera.train.data_source import build_training_data
from tessera.train.modes.mode import ModeContext, ModeParts
from tessera.train.objectives.loss import IGNORE_INDEX, masked_targets
from tessera.train.objectives.teacher import check_teacher, teacher_model_config
from tessera.train.optimizer import build_optimizer
from tessera.train.precision import autocast_dtype
from tessera.train.results import StepResult, TrainResult
from tessera.train.run.layout import RunLayout
from tessera.train.run.metric_record import StepFigures
from tessera.train.steps.step_engine import clip_parts_grad_norm, mixed_precision

KEY = "train.eagle.target"


def feature_layers_of(cfg: RunConfig, n_layers: int) -> tuple[int, ...]:
    """train.eagle.feature_layers, or the default, checked against the target's depth."""
    layers = tuple(int(j) for j in cfg.train.eagle.feature_layers) or default_feature_layers(n_layers)
    if any(j > n_layers for j in layers):
        raise ConfigError(f"train.eagle.feature_layers={list(layers)} is invalid: the target "
                          f"({cfg.train.eagle.target}) has {n_layers} layers, so block counts 0..{n_layers}")
    return layers


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A frozen target's tensor whole on this rank (FSDP holds a shard)."""
    return p.full_tensor() if isinstance(p, DTensor) else p


class EagleStep:
    """The `StepEngine` of an EAGLE run: the frozen target and the draft it trains (module docstring),
    on any data-parallel layout. The draft is its one part; `optimizer` is the draft's AdamW."""

    def __init__(self, cfg: RunConfig, layout: RunLayout):
        self.cfg, self.layout = cfg, layout
        self.device, self.dims = layout.device, layout.dims
        with layout.phase("loading the EAGLE target"):
            self.target = build_frozen_model(cfg, layout, cfg.train.eagle.target)
        self.layers = feature_layers_of(cfg, cfg.model.n_layers)
        self.vocab = self._draft_vocabulary(cfg.model.vocab_size)  # None: the target's whole vocabulary
        self.draft = self._new_draft(cfg.model)
        self.parts = [self.draft]
        self.optimizer = build_optimizer(self.draft, cfg.optim)
        self.autocast = autocast_dtype(cfg.train.dtype)

    def _new_draft(self, target_cfg: ModelConfig) -> EagleDraft:
        """The draft from `train.seed`, its head and final norm the target's (the head's rows of the
        draft vocabulary's tokens, `self.vocab`)."""
        draft = EagleDraft(draft_layer_config(target_cfg), self.layers, target_cfg.dim,
                           None if self.vocab is None else len(self.vocab))
        draft.init_weights(self.cfg.train.seed)
        with torch.no_grad():
            head = _whole(self.target.head_weight()).float()
            draft.lm_head.weight.copy_(head if self.vocab is None else head[self.vocab])
            draft.norm.weight.copy_(_whole(self.target.norm.weight).float())
            if self.vocab is not None:
                draft.d2t.copy_(self.vocab - torch.arange(len(self.vocab)))
        return draft.to(self.device).train()

    def _draft_vocabulary(self, vocab_size: int) -> torch.Tensor | None:
        """The target token ids of train.eagle.draft_vocab_size (ascending): the most frequent ones in
        the first VOCAB_SAMPLE_BATCHES global batches (read from a second iterator over the same data,
        so the training order is untouched; ties by the smaller id). None: the whole vocabulary."""
        n = self.cfg.train.eagle.draft_vocab_size
        if n is None:
            return None
        if n > vocab_size:
            raise ConfigError(f"train.eagle.draft_vocab_size={n} is invalid: the target's vocabulary has "
                              f"{vocab_size} tokens")
        batches = build_training_data(self.cfg).train
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for _ in range(VOCAB_SAMPLE_BATCHES):
            counts += torch.bincount(batches.next_batch().tokens.reshape(-1), minlength=vocab_size)
        order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
        return torch.tensor(sorted(order[:n]), dtype=torch.long)

    def _rows(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of the global batch, targets outside the loss mask ignored."""
        targets = masked_targets(batch.targets, batch.target_mask)
        if self.dims is None:
            return batch.inputs, targets
        return shard_global_batch(batch.inputs, self.dims), shard_global_batch(targets, self.dims)

    def _global(self, value: torch.Tensor) -> torch.Tensor:
        """A per-rank sum summed over the data-parallel ranks (fp64)."""
        return value.double() if self.dims is None else global_sum(value, self.dims, token_dim(self.dims))

    def scored(self, targets: torch.Tensor) -> list[torch.Tensor]:
        """For each step j, [B, S] True at the positions it is scored on: i >= j, token i+2 a loss token."""
        S = targets.shape[1]
        nxt = torch.cat([targets[:, 1:], targets.new_full((targets.shape[0], 1), IGNORE_INDEX)], dim=1)
        pos = torch.arange(S, device=targets.device)[None, :]
        return [(nxt != IGNORE_INDEX) & (pos >= j) for j in range(self.cfg.train.eagle.unroll)]

    def _micro_batch(self, inputs: torch.Tensor, masks: list[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch: [3, J], per step its cross-entropy, KL and correct
        argmax sums."""
        D = self.cfg.model.dim
        with torch.no_grad(), mixed_precision(self.device, self.autocast):
            out = self.target(ModelInput(tokens=inputs.to(self.device), keep_layers=(0, *self.layers)))
        kept = out.kept_hidden.float()
        emb = torch.cat([kept[:, 1:, :D], torch.zeros_like(kept[:, :1, :D])], dim=1)  # token i+1 at position i
        logits = torch.cat([out.logits[:, 1:], out.logits[:, :1]], dim=1).float()  # the target at i+1
        best = logits.argmax(-1)  # the target's own next token (the last row is never scored)
        if self.vocab is not None:  # its distribution over the draft's tokens
            logits = logits[..., self.vocab.to(logits.device)]
        p_target = torch.softmax(logits, dim=-1)
        with mixed_precision(self.device, self.autocast):
            outs = unrolled_outputs(self.draft, emb, kept[..., D:], len(masks))
        entropy = -(p_target * torch.log(p_target.clamp(min=1e-30))).sum(-1)  # the floor of the cross-entropy
        ce, kl, correct, objective = [], [], [], 0.0
        for h, mask, n in zip(outs, masks, counts):
            m = mask.to(self.device)
            logp = F.log_softmax(self.draft.draft_logits(h).float(), dim=-1)
            ce_j = -(p_target * logp).sum(-1)[m].sum()
            kl.append(ce_j.detach().double() - entropy[m].sum().double())
            drafted = logp.argmax(-1) if self.vocab is None else self.vocab.to(logp.device)[logp.argmax(-1)]
            correct.append((drafted == best)[m].sum().double())
            ce.append(ce_j.detach().double())
            objective = objective + ce_j / max(float(n), 1.0)
        (objective / len(masks)).backward()
        return torch.stack([torch.stack(ce), torch.stack(kl), torch.stack(correct)])

    def forward_backward(self, batch: Batch) -> StepResult:
        """The draft's gradient of a global batch (summed over the ranks); per unroll step its
        cross-entropy, KL and accuracy over the scored positions (`scalars`), their mean CE the loss."""
        inputs, targets = self._rows(batch)
        masks = self.scored(targets)
        counts = self._global(torch.stack([m.sum() for m in masks]))
        mb = self.cfg.train.micro_batch_size
        sums = torch.zeros(3, len(masks), dtype=torch.float64)  # cross-entropy, KL, correct argmaxes per step
        for r in range(0, inputs.shape[0], mb):
            sums += self._micro_batch(inputs[r:r + mb], [m[r:r + mb] for m in masks], counts).cpu()
        if self.dims is not None:
            for p in self.draft.parameters():  # every rank holds the whole draft: sum the rows' gradients
                p.grad.copy_(global_sum(p.grad, self.dims, token_dim(self.dims)).to(p.grad.dtype))
        ce, kl, correct = self._global(sums) / counts.clamp(min=1)
        scalars = {}
        for j in range(len(masks)):
            scalars.update({f"eagle_loss/{j}": float(ce[j]), f"eagle_kl/{j}": float(kl[j]),
                            f"eagle_acc/{j}": float(correct[j])})
        return StepResult(loss=float(ce.mean()), tokens=int(batch.inputs.numel()), scalars=scalars)

    def clip_grad_norm(self, max_norm: float) -> float:
        """The draft's gradient norm (whole on every rank, its gradients already summed), clipped."""
        return clip_parts_grad_norm(self.parts, max_norm, None)

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        """Nothing: the draft has no MoE layer (a step's routing counts are empty)."""

    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        raise TrainingError("an EAGLE run has no validation loss: the draft is measured by eagle_acc/{j} in "
                            "metrics.jsonl, and its mode does not evaluate (train.eval_interval is not used)")

    def draft_dir(self) -> Path:
        return Path(self.cfg.run_dir) / self.cfg.train.eagle.output_dir  # an absolute path replaces run_dir

    def write_draft(self, step: int, checkpoint: Path | None) -> Path | None:
        """The end-of-run hook: rank 0 writes the EAGLE-3 directory of the draft as trained (a run
        stopped early, at the step reached) and says where; the path on rank 0, None elsewhere."""
        written = self.layout.on_coordinator(lambda: save_eagle_draft(self.draft, self.draft_dir()))
        if self.layout.is_coordinator:
            tqdm.write(f"EAGLE draft written to {written}", file=sys.stderr)
        return written


def configure_eagle(cfg: RunConfig) -> RunConfig:
    """The run's config with the target's `model` section (read from train.eagle.target), whose
    tokenizer must be data.tokenizer."""
    target_cfg = teacher_model_config(cfg.train.eagle.target, KEY)
    cfg = replace(cfg, model=target_cfg)  # the layout and the data are the target's
    check_teacher(cfg, target_cfg, cfg.train.eagle.target, KEY)  # data.tokenizer is the target's
    return cfg


def build_eagle_mode(ctx: ModeContext) -> ModeParts:
    """The target, the draft and its optimizer (`EagleStep`), once the data's tokenizer fits the target."""
    cfg = ctx.cfg
    if ctx.data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer has {ctx.data.vocab_size} tokens, more than the target's vocabulary "
                          f"({cfg.model.vocab_size}): a draft trains on the target's tokenizer")
    step = EagleStep(cfg, ctx.layout)
    shapes = {k: tuple(v.shape) for k, v in step.draft.state_dict().items()}
    return ModeParts(engine=step, optimizers=[step.optimizer], full_shapes=shapes, record=eagle_record,
                     summary=partial(_summary, step), closing=partial(_closing, cfg), finish=step.write_draft,
                     label="eagle", evaluates=False)


def eagle_record(step: int, result: StepResult, figures: StepFigures) -> dict[str, Any]:
    """An EAGLE run's metrics line: the loss, the update and each unroll step's figures, the throughput."""
    return {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm, **result.scalars,
            "tokens_per_s": figures.throughput["tokens_per_s"]}


def _summary(step: EagleStep, start_step: int) -> list[str]:
    cfg, layout = step.cfg, step.layout
    n = sum(p.numel() for p in step.draft.parameters())
    return [f"training an EAGLE-3 draft head ({n:,} parameters, feature layers {list(step.layers)}, "
            f"{cfg.train.eagle.unroll} training-time-test steps) for the frozen target "
            f"{cfg.train.eagle.target} on {layout.world_size} rank(s), {layout.device}; metrics in "
            f"{cfg.run_dir}/metrics.jsonl"]


def _closing(cfg: RunConfig, result: TrainResult) -> tuple[list[str], list[str]]:
    """The steps trained, the last loss, where the draft went and how to serve it."""
    last = result.records[-1] if result.records else {}
    return [f"trained the EAGLE draft steps {result.start_step + 1}..{result.last_step}, last loss "
            f"{last.get('loss', math.nan):.4f}; written to {result.written}",
            f"serve with it: tessera serve {cfg.train.eagle.target} --speculative eagle --draft-model "
            f"{result.written}"], []
