"""`tessera train` with `train.eagle.target`: an EAGLE-3 draft head (tessera.models.eagle) trained
against a frozen target, written as an EAGLE-3 directory (tessera.checkpoint.eagle_dir).

    trainer = EagleTrainer(load_config("configs/tiny-dense.yaml", ["train.eagle.target=runs/tiny-dense"]))
    result = trainer.train()        # run_dir/draft: config.json + model.safetensors

The target is read from its directory and cut by the run's layout as a distillation teacher is
(tessera.train.builder.build_frozen_model: under dp_shard its weights sharded by FSDP), frozen, and
run forward under no_grad on every micro-batch, keeping its residual stream after block 0 (the
token embeddings) and after each of the draft's feature layers (`Transformer.forward`'s
`keep_layers`), and its logits. The draft then runs `unroll` steps of training-time test over the
micro-batch (`unrolled_outputs`) with the embedding of token i+1 at position i, and each step j is
scored at the positions i >= j whose token i+2 is a loss token of the data: the cross-entropy of
the draft's distribution against the target's own next-token distribution there (its softmax at
position i+1), EAGLE-3's objective. With N_j the scored positions of step j over the whole global
batch and J = unroll,

    loss = (1 / J) sum_j sum_i CE_j,i / N_j

so every data-parallel layout computes the one-process gradient: each rank holds the whole draft,
backpropagates its rows' share and the gradients are summed over the ranks before AdamW steps
(`optim`, the schedule over `train.steps`, clipping at `train.grad_clip`). metrics.jsonl logs
`loss`, `eagle_loss/{j}` (sum_i CE_j,i / N_j), `eagle_kl/{j}` (the same less the target's entropy:
KL(target || draft), what the draft can still lower) and `eagle_acc/{j}` (the fraction of scored
positions where the draft's argmax is the target's: what greedy verification accepts).

The draft starts from `train.seed` (by parameter name, tessera.models.eagle), its head and final
norm copied from the target's (the same width: a draft that starts out predicting what the target's
last layer would from its own state). With `train.eagle.draft_vocab_size` N the draft predicts over
the N target tokens most frequent in the data (EAGLE-3's reduced vocabulary, saved as d2t): its head
starts from those rows, the target's distribution is taken over them (renormalised), and
`eagle_acc` compares the drafted target token with the target's argmax over its whole vocabulary.
Checkpoints are an ordinary run's (train_checkpoint.py) with the draft as the model: every
`checkpoint.interval` steps, at the last step and on a stop signal, run_dir/checkpoints holds the
draft, its AdamW state, the step, the schedule and the data position (written synchronously: the
draft is small). `resume=True` (`tessera train --resume`) continues from the newest good one, bit
for bit as the uninterrupted run would (the target is frozen and read again from its directory);
without it a run_dir that holds checkpoints is refused, as for any run. The EAGLE-3 directory is
written at the end (a run stopped early writes it at the step reached).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from tessera.checkpoint.dcp.run_lock import RunDirLock
from tessera.checkpoint.eagle_dir import save_eagle_draft
from tessera.config.eagle import VOCAB_SAMPLE_BATCHES
from tessera.config.errors import ConfigError
from tessera.config.schema import RunConfig
from tessera.data.batching import Batch
from tessera.models.eagle import EagleDraft, default_feature_layers, draft_layer_config, unrolled_outputs
from tessera.models.model_input import ModelInput
from tessera.parallel import global_sum, shard_global_batch, token_dim
from tessera.train.builder import build_frozen_model
from tessera.train.data_source import build_training_data
from tessera.train.loss import IGNORE_INDEX, masked_targets
from tessera.train.optimizer import build_optimizer
from tessera.train.precision import autocast_dtype
from tessera.train.rng_state import seed_everything
from tessera.train.run_directory import CHECKPOINT_DIR, checkpoint_to_resume, open_metrics
from tessera.train.run_layout import build_layout
from tessera.train.schedule import LRScheduler
from tessera.train.step_engine import mixed_precision
from tessera.train.stop_signal import AgreedStop, StopSignal
from tessera.train.teacher import check_teacher, teacher_model_config
from tessera.train.train_checkpoint import load_training_state, save_training_state

KEY = "train.eagle.target"


@dataclass
class EagleResult:
    """What an EAGLE run did."""

    start_step: int
    last_step: int
    draft_dir: Path | None = None  # the directory written (rank 0; None on other ranks)
    stopped_by_signal: int | None = None
    records: list[dict[str, Any]] = field(default_factory=list)  # the metric records written (rank 0)


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


class EagleTrainer:
    """Trains the draft head of `cfg.train.eagle` (module docstring) on any data-parallel layout."""

    def __init__(self, cfg: RunConfig, resume: bool = False):
        if cfg.train.eagle.target is None:
            raise ConfigError("train.eagle.target=None: EagleTrainer trains an EAGLE draft for a target; "
                              "set it, or train the model with tessera.train.trainer.Trainer")
        target_cfg = teacher_model_config(cfg.train.eagle.target, KEY)
        self.cfg = cfg = replace(cfg, model=target_cfg)  # the layout and the data are the target's
        check_teacher(cfg, target_cfg, cfg.train.eagle.target, KEY)  # data.tokenizer is the target's
        self.layout = build_layout(cfg)
        self.device, self.dims = self.layout.device, self.layout.dims
        self.ckpt_root = Path(cfg.run_dir) / CHECKPOINT_DIR
        self.run_lock = RunDirLock(Path(cfg.run_dir))  # held by rank 0 until train() returns
        self.resumed_from = checkpoint_to_resume(self.layout, self.run_lock, Path(cfg.run_dir), resume)
        self.step, self.tokens_seen, t = 0, 0, cfg.train
        seed_everything(t.seed)
        data = self.layout.on_coordinator(lambda: build_training_data(cfg))  # rank 0 prepares a missing corpus
        self.data = data if data is not None else build_training_data(cfg)
        if self.data.vocab_size > target_cfg.vocab_size:
            raise ConfigError(f"data.tokenizer has {self.data.vocab_size} tokens, more than the target's vocabulary "
                              f"({target_cfg.vocab_size}): a draft trains on the target's tokenizer")
        with self.layout.phase("loading the EAGLE target"):
            self.target = build_frozen_model(cfg, self.layout, cfg.train.eagle.target)
        self.layers = feature_layers_of(cfg, target_cfg.n_layers)
        self.vocab = self._draft_vocabulary(target_cfg.vocab_size)  # None: the target's whole vocabulary
        self.draft = self._new_draft(target_cfg)
        self.optimizer = build_optimizer(self.draft, cfg.optim)
        self.scheduler = LRScheduler(self.optimizer, cfg.optim, t.steps)
        self.autocast = autocast_dtype(t.dtype)
        if self.resumed_from is not None:
            self._load(self.resumed_from)

    # ---- checkpoints -----------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                "data": self.data.train.state_dict()}

    def save(self) -> Path:
        """Checkpoint the draft, its optimizer, the step, schedule and data position (every rank calls it)."""
        with self.layout.phase("checkpoint save"):
            return save_training_state(self.ckpt_root, self.step, [self.draft], [self.optimizer],
                                       self._trainer_state(), self.cfg, self.layout.rank, self.layout.world_size)

    def _load(self, path: Path) -> None:
        shapes = {k: tuple(v.shape) for k, v in self.draft.state_dict().items()}
        with self.layout.phase("checkpoint load"):
            trainer = load_training_state(path, [self.draft], [self.optimizer], shapes, self.cfg,
                                          self.layout.rank, self.layout.world_size)
        self.step, self.tokens_seen = int(trainer["step"]), int(trainer["tokens_seen"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.data.train.load_state_dict(trainer["data"])

    def _new_draft(self, target_cfg) -> EagleDraft:
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

    # ---- one step --------------------------------------------------------------------------
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

    def _micro_batch(self, inputs: torch.Tensor, masks: list[torch.Tensor], counts: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch: per step, its cross-entropy sums and correct argmaxes."""
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

    def train_step(self, batch: Batch) -> dict[str, Any]:
        """One optimizer step of the draft on a global batch; its statistics."""
        self.step += 1
        self.tokens_seen += int(batch.inputs.numel())
        lr = self.scheduler.set_step(self.step)
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
        clip = self.cfg.train.grad_clip
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.draft.parameters(), clip if clip > 0 else math.inf))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        ce, kl, correct = self._global(sums) / counts.clamp(min=1)
        stats = {"loss": float(ce.mean()), "lr": lr, "grad_norm": grad_norm, "tokens": int(batch.inputs.numel())}
        for j in range(len(masks)):
            stats.update({f"eagle_loss/{j}": float(ce[j]), f"eagle_kl/{j}": float(kl[j]),
                          f"eagle_acc/{j}": float(correct[j])})
        return stats

    # ---- the loop --------------------------------------------------------------------------
    def draft_dir(self) -> Path:
        return Path(self.cfg.run_dir) / self.cfg.train.eagle.output_dir  # an absolute path replaces run_dir

    def train(self) -> EagleResult:
        """Train to `train.steps` (or an agreed stop signal), checkpointing as an ordinary run does, then
        write the draft directory on rank 0."""
        layout = self.layout
        if layout.is_coordinator:
            self.run_lock.acquire()  # again, after an earlier train() released it
        writer = open_metrics(layout, self.cfg, self.step if self.resumed_from is not None else None)
        result = EagleResult(start_step=self.step, last_step=self.step)
        bar = tqdm(total=self.cfg.train.steps, initial=self.step, desc="eagle", unit="step", dynamic_ncols=True,
                   disable=not (self.cfg.log.progress_bar and layout.is_coordinator))
        try:
            with StopSignal() as signal:
                stop = AgreedStop(signal, layout.max_over_ranks if layout.distributed else None)
                self._run_steps(stop, writer, bar, result)
                result.stopped_by_signal = stop.received
            result.draft_dir = layout.on_coordinator(lambda: save_eagle_draft(self.draft, self.draft_dir()))
        finally:
            bar.close()
            if writer is not None:
                writer.close()
            self.run_lock.release()
        result.last_step = self.step
        if layout.is_coordinator:
            print(f"EAGLE draft written to {result.draft_dir}", file=sys.stderr)
        return result

    def _run_steps(self, stop: AgreedStop, writer, bar: tqdm, result: EagleResult) -> None:
        """Steps until `train.steps` or an agreed stop, each logged and checkpointed when due."""
        t, interval = self.cfg.train, self.cfg.checkpoint.interval
        while self.step < t.steps and not stop.requested:
            start = time.perf_counter()
            stats = self.train_step(self.data.train.next_batch())
            stats["tokens_per_s"] = stats.pop("tokens") / max(time.perf_counter() - start, 1e-9)
            stop.agree()
            last = self.step == t.steps
            if self.step % t.log_interval == 0 or self.step in (result.start_step + 1, t.steps) or stop.requested:
                record = {"step": self.step, **stats}
                if writer is not None:
                    writer.write(record)
                    result.records.append(record)
            bar.update(1)
            if last or stop.requested or (interval > 0 and self.step % interval == 0):
                self.save()
