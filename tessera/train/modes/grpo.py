"""The GRPO mode (train/modes/registry.py, `train.objective: grpo`): Group Relative Policy Optimization
of the `model` section's model on prompts (data.kind=prompts, tessera.data.prompts), with rollouts
sampled by Tessera's own serving engine in the same process.

    rollouts = tessera.eval.rollouts.EngineRollouts(cfg)       # the engine and the reward; tessera train makes it
    trainer = Trainer(cfg, rollouts=rollouts)

The training layer does not import the serving engine (tests/test_layers.py), so the engine comes in
as a `RolloutSource`: the mode binds it to the policy once it is built (`bind`: the engine then reads
the policy's own parameters, so after each optimizer step it decodes with the new weights without a
checkpoint), and each step asks it for `group_size` completions of each of this rank's prompts with
their rewards and the engine's log-probabilities of the sampled tokens (`Rollouts`).

A step, on each rank for its rows of the global batch (`train.global_batch_size` prompts, each rank
taking its share, `train.micro_batch_size` prompts a micro-batch): the rollouts; each group's rewards
normalised into advantages; the policy's log-probabilities of the completions (the logits divided by
`train.grpo.temperature`, the distribution the engine sampled from) in one forward with the gradient,
over shared-prefix rows (a group's prompt once, its completions attending to it: grpo_packing.py;
one row per completion where the model or layout cannot, `rows_refusal`, said in the start-up lines);
the clipped policy-gradient loss (tessera.train.objectives.policy_gradient), weighted by the truncated
importance weights of the engine's log-probabilities against the trainer's at the sampling policy
(`tis_cap`), plus `kl_coef` x the k3 KL to a frozen reference (the run's initial weights, built only
when kl_coef > 0) and minus `entropy_coef` x the entropy. Each micro-batch backpropagates its loss
sum divided by the global batch's divisor (its completion tokens, or its completions), so every
data-parallel and tensor-parallel layout accumulates the one-process gradient (under tp the
log-probabilities come from the vocabulary-sharded logits: objectives/loss.py `token_logps`; under
sp the packed rollouts are padded to a multiple of tp). Tensor-parallel peers, which hold the same
prompts, sample every tp-th of them each and gather the others' (`_rollouts`).

`updates_per_rollout` = k: the step makes k passes over its rollouts (PPO epochs); the first is at
the sampling policy (ratio 1) and records its log-probabilities, the others at the policy the
previous passes moved, whose ratio to them the clip range bounds. The step applies the first k - 1
updates itself (clipped as the trainer clips, `_inner_update`) and leaves the last one's gradient to
the trainer; `loss`, `kl` and `clip_fraction` are means over the k passes, the MoE routing figures
those of the last. `bitwise`: before the first pass the policy scores the sampled tokens under
no_grad in the very micro-batches the passes run (`_score`), and these replace the engine's
log-probabilities, so the importance weights are exactly 1 and logprob_diff_* exactly 0. Otherwise, in
an fp32 run (`fp64_attention`, on by default) the policy's attention computes in float64 and rounds its
outputs back (`wide_causal_attention`), as the engine's does: each output is then the fp32 value nearest
the exact one whatever order either sums in, so the engine's log-probabilities agree with the trainer's
to ~1e-7 without a second forward.

metrics.jsonl logs, besides an ordinary step's figures, `loss` (the objective), `reward_mean`,
`reward_std` (over the global batch's completions), `kl` (mean k3 per completion token; 0 without a
reference), `clip_fraction` (of completion tokens), `response_length` (mean completion tokens),
`logprob_diff_max`, `logprob_diff_mean` (|engine - trainer| log-probability of the sampled tokens, both
of the raw distribution), `rollout_tokens_per_s` (completion tokens the engine sampled per second of
rollout, over the ranks) and `reward_failures` (completions whose reward raised or was not a number,
scored 0). `loss_tokens` counts completion tokens. There is no evaluation; checkpoints, resuming and
`checkpoint.export_hf` are a language-model run's (train/modes/lm.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tessera.config.errors import ConfigError, TrainingError
from tessera.config.schema import RunConfig
from tessera.config.training.grpo import wide_attention
from tessera.data.batching import Batch
from tessera.models.attention import causal_attention, wide_causal_attention
from tessera.models.attention_variants.shared_prefix import shared_prefix_refusal
from tessera.parallel import dp_rows, global_sum
from tessera.train.builder import TrainingParts, build_frozen_model, build_training_parts
from tessera.train.modes.grpo_packing import Chunk, row_chunks, row_tokens, shared_prefix_chunks
from tessera.train.modes.lm import export_hf, lm_closing, lm_summary
from tessera.train.modes.mode import ModeContext, ModeParts
from tessera.train.objectives.loss import token_logps
from tessera.train.objectives.policy_gradient import group_advantages, policy_loss_sum, tis_weights, token_entropy
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


@dataclass
class Rollouts:
    """What a `RolloutSource` returns for P prompts: P x group_size completions, prompt 0's first."""

    completions: list[list[int]]  # each completion's token ids (at least one token)
    engine_logps: list[list[float]]  # the engine's log-probability of each of them (raw distribution)
    rewards: list[float]  # each completion's reward (0.0 where the reward failed)
    reward_failures: int  # completions whose reward raised or gave no finite number
    seconds: float  # wall-clock seconds the sampling took


class RolloutSource(Protocol):
    """The serving engine as the GRPO step sees it (tessera.eval.rollouts.EngineRollouts). Under tp,
    `spans_tp` says that the tp peers sample together, one engine over their shards: each is then
    handed all of its step's prompts and returns the same rollouts (read only when tp > 1)."""

    spans_tp: bool

    def bind(self, model: nn.Module, layout: RunLayout) -> None:
        """Sample with `model`'s current weights from now on (called once, when the policy is built)."""

    def rollouts(self, prompts: list[list[int]], records: list[dict[str, Any]], seeds: list[int]) -> Rollouts:
        """`group_size` completions of each prompt (its token ids; `records`: what the reward reads;
        `seeds`: its completions' sampling seeds are seed, seed + 1, ..., seed + group_size - 1)."""


class GRPOStep:
    """The `StepEngine` of a GRPO run: the policy (its one part), the rollouts and, with kl_coef > 0,
    the frozen reference; in one process or under dp_replicate / dp_shard (module docstring)."""

    def __init__(self, cfg: RunConfig, layout: RunLayout, built: TrainingParts, reference: nn.Module | None,
                 rollouts: RolloutSource, position: Callable[[], int], rows_refusal: str | None = None):
        self.parts = built.parts
        self.rows_refusal = rows_refusal  # why shared-prefix rows are not used (None: they are; grpo_packing.py)
        self.model, self.reference, self.rollout_source = built.parts[0], reference, rollouts
        self.dims, self.device = layout.dims, layout.device
        self.mb, self.autocast, self.g = cfg.train.micro_batch_size, built.autocast_dtype, cfg.train.grpo
        self.seed, self.position = cfg.train.seed, position  # position: samples the run has drawn (resumed too)
        self.distributed_optimizers = built.distributed_optimizers
        self.optimizers, self.grad_clip = built.optimizers, cfg.train.grad_clip  # updates_per_rollout > 1
        # sequence parallelism splits each sequence over the tp ranks: packed rollouts are padded to it
        self.sequence_multiple = layout.dims.tp if layout.dims is not None and layout.dims.sp else 1
        # the policy attends in float64 as the engine does (EngineConfig.fp64_attention): its attention core
        # over whole rows, the SharedPrefixMask over shared-prefix rows (the reference keeps fp32)
        self.attention_dtype = torch.float64 if wide_attention(cfg) else None
        if self.attention_dtype is not None:
            for module in self.model.modules():
                _widen(module, "attention_core")
        rollouts.bind(self.model, layout)

    def _rows(self, batch: Batch) -> tuple[list[list[int]], list[dict[str, Any]], list[int]]:
        """This rank's prompts of the global batch: their token ids, records and sampling seeds (each
        from the run's seed, the step and the prompt's row in the global batch, so that every layout
        samples the same completions as one process, and a resumed run those of the straight one)."""
        n, G = batch.tokens.shape[0], self.g.group_size
        rows = range(n) if self.dims is None else range(n)[dp_rows(n, self.dims)]
        records = batch.records or [{} for _ in range(n)]
        base = hash((self.seed, self.position())) % 2**31  # ints hash the same in every process
        return ([batch.tokens[r][batch.loss_mask[r]].tolist() for r in rows], [records[r] for r in rows],
                [base + r * G for r in rows])

    def _rollouts(self, prompts: list[list[int]], records: list[dict[str, Any]], seeds: list[int]) -> Rollouts:
        """The rollouts of this rank's prompts. Tensor-parallel peers hold the same prompts: each samples
        every tp-th of them (their seeds unchanged, so the completions are those one rank would sample)
        and the peers gather the others' (`merge_rollouts`), unless the source's engine spans the tp
        group (its shards the policy's: `spans_tp`), which samples them all together."""
        tp = self.dims.tp if self.dims is not None else 1
        if tp == 1 or self.rollout_source.spans_tp:
            return self.rollout_source.rollouts(prompts, records, seeds)
        r = self.dims.local_rank("tp")
        mine = self.rollout_source.rollouts(prompts[r::tp], records[r::tp], seeds[r::tp])
        parts: list[Any] = [None] * tp
        dist.all_gather_object(parts, mine, group=self.dims["tp"].get_group())
        return merge_rollouts(parts, len(prompts), self.g.group_size)

    def _sync_gradients(self, last_micro_batch: bool) -> None:
        sync_gradients(self.model, self.distributed_optimizers, last_micro_batch)

    def _forward(self, model: nn.Module, chunk: Chunk) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """`model`'s forward on a chunk (grpo_packing.py): its output, the fp32 logits of the rows the
        chunk's targets score and the targets [R, K], on the device."""
        with mixed_precision(self.device, self.autocast):
            out = model(chunk.model_input(self.device, self.attention_dtype if model is self.model else None))
        y, logits = chunk.targets.to(self.device), out.logits.float()
        if logits.shape[1] > y.shape[1]:  # the model kept every position (a sequence-sharded input)
            logits = logits[:, -y.shape[1]:]
        return out, y, logits

    @torch.no_grad()
    def _score(self, chunks: list[Chunk]) -> None:
        """train.grpo.bitwise: the log-probabilities of the sampled tokens by the scoring pass the trainer
        runs (the policy module, its micro-batches, their layout and padding) replace each chunk's
        engine's, so that they equal the trainer's bit for bit."""
        for chunk in chunks:
            _, y, logits = self._forward(self.model, chunk)
            chunk.engine = token_logps(logits, y).reshape(chunk.mask.shape).cpu()

    def _micro_batch(self, chunk: Chunk, old: tuple[torch.Tensor, torch.Tensor] | None, divisor: int,
                     micro_batches: int, stats: StepStats) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Forward and backward of the policy on a chunk's completions; its loss, clipped, kl and
        |engine - trainer| sums (fp64) and the largest difference, and the (tempered, raw)
        log-probabilities of the rollout's policy (`old`: those of the first update)."""
        g = self.g
        out, y, logits = self._forward(self.model, chunk)
        m, engine = chunk.mask.to(self.device), chunk.engine.to(self.device)

        def logps_of(lg: torch.Tensor, temperature: float) -> torch.Tensor:  # [n, T], the completions' shape
            return token_logps(lg if temperature == 1 else lg / temperature, y).reshape(m.shape)
        raw = logps_of(logits, 1)  # the distribution the engine reports
        logps = raw if g.temperature == 1 else logps_of(logits, g.temperature)
        old = old if old is not None else (logps.detach(), raw.detach())  # the first update: the sampling policy
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = logps_of(self._forward(self.reference, chunk)[2], g.temperature)
        weights = tis_weights(old[1], engine, g.tis_cap) if g.tis_cap is not None else None
        entropies = token_entropy(logits / g.temperature).reshape(m.shape) if g.entropy_coef else None
        pl = policy_loss_sum(logps, old[0], chunk.advantages.to(self.device), m, clip_low=g.clip_low,
                             clip_high=g.clip_high, averaging=g.loss_averaging, ref_logps=ref, kl_coef=g.kl_coef,
                             weights=weights, entropies=entropies, entropy_coef=g.entropy_coef)
        (pl.loss_sum / divisor + out.aux_loss.float() / micro_batches).backward()
        stats.add_routing(out)
        diff = ((old[1] - engine).abs() * m).double()
        return torch.stack([pl.loss_sum.detach().double(), pl.clipped.double(), pl.kl_sum.double(), diff.sum(),
                            diff.max()]), old

    def _inner_update(self) -> None:
        """An optimizer step of updates_per_rollout > 1 before the last (whose gradients the trainer
        clips and applies): clipped as the trainer clips, skipped when the norm is not finite."""
        if math.isfinite(self.clip_grad_norm(self.grad_clip)):
            for optimizer in self.optimizers:
                optimizer.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, batch: Batch) -> StepResult:
        """Rollouts of this rank's prompts, then `updates_per_rollout` updates of the policy on them:
        each but the last applied here, the last one's gradient of the global batch's GRPO objective
        (summed over the ranks) left to the trainer; the step's figures (`scalars`, module docstring)."""
        prompts, records, seeds = self._rows(batch)
        ro = self._rollouts(prompts, records, seeds)
        self.model.train()
        G, updates = self.g.group_size, self.g.updates_per_rollout
        rewards = torch.tensor(ro.rewards, dtype=torch.float32)
        advantages = group_advantages(rewards, G, scale=self.g.scale_rewards)
        if self.rows_refusal is None:
            chunks = shared_prefix_chunks(prompts, ro.completions, ro.engine_logps, G, self.mb, advantages)
        else:
            chunks = row_chunks(prompts, ro.completions, ro.engine_logps, G, self.mb, advantages,
                                self.sequence_multiple)
        local = sum(_local_divisor(c.mask, self.g.loss_averaging) for c in chunks)
        divisor = max(int(local if self.dims is None else global_sum(local, self.dims).item()), 1)
        n_local = len(chunks)
        micro_batches = n_local * (self.dims.dp_size if self.dims is not None else 1)
        if self.g.bitwise:
            self._score(chunks)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        diff_max = torch.zeros((), dtype=torch.float64, device=self.device)
        old: list[Any] = [None] * n_local
        for update in range(updates):
            if update:
                self._inner_update()
            stats = StepStats()  # the routing of the last update, whose gradient the trainer applies
            for i, chunk in enumerate(chunks):
                self._sync_gradients(i == n_local - 1)
                out, old[i] = self._micro_batch(chunk, old[i], divisor, micro_batches, stats)
                sums += torch.cat([out[:3] / updates, out[3:4] * (update == 0)])
                diff_max = torch.maximum(diff_max, out[4])
        tokens = sum(int(c.mask.sum()) for c in chunks)
        seq_tokens = row_tokens(prompts, ro.completions, G, self.sequence_multiple)
        counts = torch.tensor([rewards.sum(), (rewards.double() ** 2).sum(), rewards.numel(), tokens,
                               ro.reward_failures, ro.seconds, seq_tokens], dtype=torch.float64)
        return self._result(batch, sums.cpu(), diff_max.cpu(), counts, divisor, stats, micro_batches)

    def _result(self, batch: Batch, sums: torch.Tensor, diff_max: torch.Tensor, counts: torch.Tensor, divisor: int,
                stats: StepStats, micro_batches: int) -> StepResult:
        """The step's figures over every rank (module docstring)."""
        seconds = counts[5].clone()
        if self.dims is not None:
            sums, counts = global_sum(sums, self.dims), global_sum(counts, self.dims)
            diff_max, seconds = _global_max(diff_max, self.dims), _global_max(seconds, self.dims)
        stats = reduce_over_ranks(stats, self.dims)
        loss_sum, clipped, kl_sum, diff_sum = sums.tolist()
        r_sum, r_sq, n, tokens, failures, _, seq_tokens = counts.tolist()
        mean = r_sum / n
        scalars = {"reward_mean": mean, "reward_std": max(r_sq / n - mean * mean, 0.0) ** 0.5,
                   "kl": kl_sum / max(tokens, 1), "clip_fraction": clipped / max(tokens, 1),
                   "response_length": tokens / n, "logprob_diff_max": float(diff_max),
                   "logprob_diff_mean": diff_sum / max(tokens, 1),
                   "rollout_tokens_per_s": tokens / max(float(seconds), 1e-9), "reward_failures": failures}
        return StepResult(loss=loss_sum / max(divisor, 1), tokens=int(seq_tokens), loss_tokens=int(tokens),
                          aux_loss=stats.aux_total / micro_batches,
                          aux_parts={k: v / micro_batches for k, v in stats.aux_parts.items()},
                          counts=stats.counts, scalars=scalars)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_parts_grad_norm(self.parts, max_norm, self.dims,
                                    distributed_optimizers=self.distributed_optimizers)

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        update_parts_expert_bias(self.parts, counts, self.device)

    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        raise TrainingError("a GRPO run has no validation loss: its reward figures in metrics.jsonl measure it, "
                            "and its mode does not evaluate (train.eval_interval must be 0)")


def merge_rollouts(parts: list[Rollouts], prompts: int, group_size: int) -> Rollouts:
    """The rollouts of `prompts` prompts from `parts`, part r holding those of prompts r, r + n, r + 2n, ...
    (n = len(parts)), in prompt order; failures summed, seconds the longest part's."""
    n, order = len(parts), []
    for i in range(prompts):
        order += [(i % n, (i // n) * group_size + j) for j in range(group_size)]
    return Rollouts(completions=[parts[r].completions[k] for r, k in order],
                    engine_logps=[parts[r].engine_logps[k] for r, k in order],
                    rewards=[parts[r].rewards[k] for r, k in order],
                    reward_failures=sum(p.reward_failures for p in parts), seconds=max(p.seconds for p in parts))


def _widen(holder: Any, name: str) -> None:
    """`holder.name`, an attention core, set to `wide_causal_attention` where it is `causal_attention`, or
    where a recomputation wrapper (`inner`: parallel.recompute selective or op) holds it; other cores
    (context parallelism's) are left."""
    core = getattr(holder, name, None)
    if core is causal_attention:
        setattr(holder, name, wide_causal_attention)
    elif core is not None and hasattr(core, "inner"):
        _widen(core, "inner")


def _local_divisor(mask: torch.Tensor, averaging: str) -> int:
    return int(mask.sum()) if averaging == "token" else int(mask.shape[0])


def _global_max(value: torch.Tensor, dims: Any) -> torch.Tensor:
    t = value.detach().clone().to(torch.float64)
    if dims.dp_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dims["dp"].get_group())
    return t


def build_grpo_mode(ctx: ModeContext) -> ModeParts:
    """The policy (the run's model, its optimizer), the frozen reference when kl_coef > 0, and their
    step engine bound to the rollout source the run was given."""
    cfg, layout = ctx.cfg, ctx.layout
    if ctx.rollouts is None:
        raise ConfigError("train.objective=grpo needs the serving engine's rollouts: tessera train makes them; from "
                          "Python pass Trainer(cfg, rollouts=tessera.eval.rollouts.EngineRollouts(cfg))")
    if ctx.data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is invalid: the tokenizer has "
                          f"{ctx.data.vocab_size} tokens, so it must be >= {ctx.data.vocab_size}")
    built = build_training_parts(cfg, layout, ctx.init_from, False)  # the engine runs the blocks as they are
    reference = None
    if cfg.train.grpo.kl_coef > 0:
        with layout.phase("building the GRPO reference model"):
            reference = build_frozen_model(cfg, layout, cfg.train.init_from)
    refusal = rows_refusal(cfg, layout, built.parts[0])
    return ModeParts(
        engine=GRPOStep(cfg, layout, built, reference, ctx.rollouts, lambda: ctx.data.train.samples_seen, refusal),
        optimizers=built.optimizers,
        full_shapes=built.full_shapes, record=partial(step_record, moe=cfg.model.is_moe),
        summary=partial(_summary, cfg, layout, refusal), closing=partial(lm_closing, cfg),
        finish=partial(export_hf, cfg, layout), label="grpo", evaluates=False, init_from=ctx.init_from,
        init_bytes_read=built.init_bytes_read, fp8_layers=built.fp8_layers)


def rows_refusal(cfg: RunConfig, layout: RunLayout, model: nn.Module) -> str | None:
    """Why the step lays its rollouts out in per-completion rows rather than shared-prefix rows (None:
    it does not; grpo_packing.py): switched off, a layout or a model that cannot serve them."""
    if not cfg.train.grpo.shared_prefix:
        return "train.grpo.shared_prefix=false"
    if layout.dims is not None and layout.dims.sp:
        return "parallel.sp=true splits each row's positions over tp, which the shared-prefix mask does not follow"
    return shared_prefix_refusal(cfg.model, getattr(model, "mrope_section", None))


def _summary(cfg: RunConfig, layout: RunLayout, refusal: str | None, start_step: int) -> list[str]:
    """A language-model run's lines, what GRPO samples and rewards, and how its update lays out the rollouts."""
    g = cfg.train.grpo
    kl = f"k3 KL x {g.kl_coef:g} to the initial weights" if g.kl_coef > 0 else "no KL term"
    return lm_summary(cfg, layout, start_step) + [
        f"objective: GRPO, {g.group_size} completions per prompt of up to {g.max_new_tokens} tokens at temperature "
        f"{g.temperature:g} from the serving engine, reward {g.reward}, {g.loss_averaging}-level averaging, {kl}; "
        "metrics reward_mean, reward_std, kl, clip_fraction, response_length, logprob_diff_max, logprob_diff_mean, "
        "rollout_tokens_per_s",
        "update rows: shared-prefix (each group's prompt computed once)" if refusal is None else
        f"update rows: one per completion (shared-prefix rows refused: {refusal})"]
