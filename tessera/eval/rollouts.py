"""GRPO's rollouts by Tessera's own serving engine, in the training process (the `RolloutSource` of
tessera.train.modes.grpo; `tessera train` passes one to the trainer for train.objective=grpo).

    trainer = Trainer(cfg, rollouts=EngineRollouts(cfg))

Made before the trainer, it loads the reward (tessera.eval.rewards: a reward module that does not
exist stops the run in one line before anything is built) and the run's tokenizer. `bind` gives it
the policy as the trainer built it:

- in one process (and under dp_replicate, where every rank holds whole tensors) the engine is built
  around the policy module itself (`LLMEngine.from_model`, not owned: no packing or fusing), so it
  reads the very parameters the optimizer updates in place: after each step it decodes with the new
  weights, with no copy and no checkpoint;
- under tp alone, where the serving plan cuts the model as the trainer did, the engine's shards are
  the trainer's (`tessera.infer.runner.tp_shared.alias_shards`: the same storage, no copy, updates
  seen without a sync): the tp group's rank 0 drives one engine over all of the step's prompts
  (`LLMEngine.from_group_shard`), its peers run the same forwards on their shards
  (`serve_group_steps`), and rank 0's rollouts are broadcast to them (`spans_tp`: the step hands
  every tp rank all of its prompts);
- under dp_shard and tp, where the policy's parameters are cut over tp as serving cuts them and
  sharded over dp_shard besides, the engine keeps a copy of this rank's tp shard only
  (`gathered_shards`), driven as above by the tp group's rank 0, and before each rollout phase (after
  each optimizer step) every rank gathers each parameter over dp_shard into it in place
  (`gather_shards`: a collective copy, no checkpoint);
- under dp_shard alone (or where the tp cut differs), it keeps a whole copy of the model, and before
  each rollout phase every rank gathers each parameter (`full_tensor`, a collective over the shards'
  ranks) into that copy in place.

The tp-sharing engine is built for each rollout phase and closed after it (which releases the
peers). Any other engine is built at the first rollout phase (its paged KV cache sized for the
phase's sequences) and kept: each phase wakes it (the KV cache allocated again, empty), adds `group_size`
requests per prompt (one seeded request per completion, which the engine batches continuously,
with its prefix cache on: each prompt's first request is prefilled a step before the rest of its
group, which then find its whole blocks cached), steps it until every request has finished, and puts it to sleep
(`LLMEngine.sleep`: the KV cache's memory released and the prefix cache emptied, since the next
phase decodes with new weights), so the training step's activations have the memory to themselves.
In an fp32 run the engine attends in float64 as the trainer does (`train.grpo.fp64_attention`,
EngineConfig.fp64_attention), so that its log-probabilities agree with the trainer's whatever order
each sums in. Every request asks for the log-probability of each sampled token (SamplingParams.logprobs=0: of the
raw distribution), which the step compares with the trainer's. The completion's text (special tokens
skipped) is scored by the reward with the record's fields.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.config.errors import ConfigError, TrainingError
from tessera.config.schema import RunConfig
from tessera.config.training.grpo import wide_attention
from tessera.data.tokenizer import load_tokenizer
from tessera.eval.rewards import RewardFn, load_reward, score
from tessera.infer.config import EngineConfig
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.runner.tp_shared import alias_shards, gather_shards, gathered_shards, serve_group_steps
from tessera.infer.sampling.params import SamplingParams
from tessera.models.transformer import Transformer
from tessera.train.modes.grpo import Rollouts
from tessera.train.run.layout import RunLayout


class EngineRollouts:
    """The serving engine and the reward of a GRPO run (module docstring)."""

    def __init__(self, cfg: RunConfig, reward: RewardFn | None = None):
        self.cfg, self.g = cfg, cfg.train.grpo
        self.reward = reward if reward is not None else load_reward(self.g)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.eos_ids = frozenset() if self.tokenizer.eos_id is None else frozenset({self.tokenizer.eos_id})
        self.model: nn.Module | None = None  # what the engine runs: the policy itself, or its whole copy
        self.source: nn.Module | None = None  # the sharded policy the copy is gathered from (dp_shard)
        self.device = torch.device("cpu")
        self.kept: LLMEngine | None = None  # the engine of the rollout phases, asleep between them
        self.tp_group = None  # the trainer's tp group when the engine's shards are the policy's (spans_tp)

    @property
    def spans_tp(self) -> bool:
        """Whether the tp ranks sample together (each is handed all of its step's prompts)."""
        return self.tp_group is not None

    def bind(self, model: nn.Module, layout: RunLayout) -> None:
        """Sample with `model`'s weights: shared where its tensors are whole or cut as serving cuts
        them, else gathered each phase. Every rank hears whether any failed (`_agreed`), so that one
        failing here stops them all now, not at their first collective's timeout."""
        error = None
        try:
            self._bind(model, layout)
        except Exception as e:
            error = e
        _agreed(error, "build the rollout engine's weights")

    def _bind(self, model: nn.Module, layout: RunLayout) -> None:
        self.device = layout.device
        dims = layout.dims
        tp = dims is not None and dims.tp > 1
        shards = alias_shards(model, dims) if tp else None
        if shards is not None:
            self.model, self.tp_group = shards, dims["tp"].get_group()
        elif tp and (own := gathered_shards(model, dims)) is not None:  # dp_shard over tp: gathered, still cut
            self.model, self.tp_group, self.source = own, dims["tp"].get_group(), model
        elif any(isinstance(p, DTensor) for p in model.parameters()):
            self.source = model
            with torch.device(self.device):
                self.model = Transformer(self.cfg.model).requires_grad_(False)
        else:
            self.model = model

    def sync(self) -> None:
        """The copy's parameters gathered from the policy's shards (every rank calls it; none without a copy)."""
        if self.source is None:
            return
        if self.spans_tp:  # this rank's tp shard, gathered over dp_shard
            gather_shards(self.model, self.source)
            return
        mine = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in self.source.named_parameters():
                mine[name].copy_(p.full_tensor() if isinstance(p, DTensor) else p)

    def config(self, sequences: int) -> EngineConfig:
        """The engine's settings for a phase of `sequences` requests (every tp rank's alike)."""
        if self.model is None:
            raise ConfigError("EngineRollouts.bind(model, layout) must come before the first rollout")
        dtype = next(self.model.parameters()).dtype
        tp = dist.get_world_size(self.tp_group) if self.spans_tp else 1
        return EngineConfig(dtype=str(dtype).removeprefix("torch."), device=str(self.device),
                            max_model_len=min(self.cfg.train.seq_len + 1, self.cfg.model.max_seq_len),
                            max_num_seqs=max(sequences, 1), enforce_eager=True, cpu_prepack=False,
                            seed=self.cfg.train.seed, tensor_parallel_size=tp,
                            fp64_attention=wide_attention(self.cfg))

    def engine(self, sequences: int) -> LLMEngine:
        """The engine around the bound model for a phase of `sequences` requests (on the tp group's
        rank 0 when the shards are the policy's: its peers must be serving, `serve_group_steps`)."""
        config = self.config(sequences)
        if self.spans_tp:
            return LLMEngine.from_group_shard(self.model, config, self.tokenizer, self.eos_ids, self.tp_group)
        return LLMEngine.from_model(self.model, config, self.tokenizer, self.eos_ids)

    def phase_engine(self, sequences: int) -> LLMEngine:
        """The kept engine, awake (built again only when a phase has more sequences than it was built for)."""
        if self.kept is not None and self.kept.config.max_num_seqs < sequences:
            self.kept.close()
            self.kept = None
        if self.kept is None:
            self.kept = self.engine(sequences)
        self.kept.wake()
        return self.kept

    def rollouts(self, prompts: list[list[int]], records: list[dict[str, Any]], seeds: list[int]) -> Rollouts:
        """`group_size` completions of each prompt, their engine log-probabilities and rewards."""
        if self.spans_tp:
            return self._group_rollouts(prompts, records, seeds)
        self.sync()
        G = self.g.group_size
        start = time.perf_counter()
        engine = self.phase_engine(len(prompts) * G)
        self.model.eval()  # the trainer's step put the policy in training mode
        try:
            outputs = _generate(engine, prompts, G, self.g.max_new_tokens, self.g.temperature, seeds)
        except BaseException:
            engine.close()
            self.kept = None
            raise
        engine.sleep()
        return self._scored(outputs, records, time.perf_counter() - start)

    def _group_rollouts(self, prompts: list[list[int]], records: list[dict[str, Any]], seeds: list[int]) -> Rollouts:
        """The tp group's rollouts of all of `prompts`: rank 0 drives an engine over its shard for the
        phase (closing it releases the peers), the peers serve its steps, and its rollouts reach them
        by broadcast. The engine is built for each phase: its KV cache lives only during it. Whether
        every rank built its part is agreed before the first step, so a failure building on any rank
        reaches the others at once with its reason."""
        group, start = self.tp_group, time.perf_counter()
        self.sync()
        got: list[Any] = [None]
        self.model.eval()
        if dist.get_rank(group) == 0:
            # a failure building on any rank of the group raises on all of them here (tp_shared.agreed_build)
            engine = self.engine(len(prompts) * self.g.group_size)
            try:
                outputs = _generate(engine, prompts, self.g.group_size, self.g.max_new_tokens, self.g.temperature,
                                    seeds)
                got[0] = self._scored(outputs, records, time.perf_counter() - start)
            except Exception as e:  # the peers hear of it instead of waiting for rollouts
                got[0] = f"the tp group's rank 0 failed its rollouts: {e}"
                raise
            finally:
                engine.close()  # its STOP ends the peers' serving
                dist.broadcast_object_list(got, group=group, group_src=0)
        else:  # raises as the driver does where a rank of the group failed to build
            serve_group_steps(self.model, self.config(len(prompts) * self.g.group_size), group)
            dist.broadcast_object_list(got, group=group, group_src=0)
            if isinstance(got[0], str):
                raise TrainingError(got[0])
        return got[0]

    def _scored(self, outputs: list[Any], records: list[dict[str, Any]], seconds: float) -> Rollouts:
        """The rollouts of the engine's `outputs`: their tokens, log-probabilities and rewards."""
        G = self.g.group_size
        rewards, failures = [], 0
        for i, out in enumerate(outputs):
            value, failed = score(self.reward, records[i // G].get("prompt"), out.text, records[i // G])
            rewards.append(value)
            failures += failed
        return Rollouts(completions=[list(o.token_ids) for o in outputs],
                        engine_logps=[[lp.logprob for lp in o.logprobs] for o in outputs], rewards=rewards,
                        reward_failures=failures, seconds=seconds)


def _agreed(error: Exception | None, doing: str) -> None:
    """Raise on every rank if any rank's `error` is set (one gather of the ranks' outcomes; in one
    process, the error itself), naming the first failing rank and its reason."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, reason) for rank, reason in enumerate(reasons) if reason is not None]
    if failed:
        raise TrainingError(f"rank {failed[0][0]} failed to {doing}: {failed[0][1]}") from error


def _generate(engine: LLMEngine, prompts: list[list[int]], group_size: int, max_new_tokens: int,
              temperature: float, seeds: list[int]) -> list[Any]:
    """Every prompt's `group_size` finished outputs, in order; a request that fails stops the run.
    Python's cyclic garbage collector is off meanwhile: the engine's steps make many small objects,
    and each full collection they set off would walk the trainer's whole heap (the model, its
    optimizer state, the run's records) for cycles the loop does not make; it runs again after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _stepped(engine, prompts, group_size, max_new_tokens, temperature, seeds)
    finally:
        if enabled:
            gc.enable()


def _stepped(engine: LLMEngine, prompts: list[list[int]], group_size: int, max_new_tokens: int,
             temperature: float, seeds: list[int]) -> list[Any]:
    """The requests stepped to the end. Each prompt's first completion is added alone and stepped once:
    its prefill puts the prompt's whole KV blocks in the prefix cache, so the group's other completions,
    added after, prefill only the prompt's last partial block instead of the whole prompt again. Each
    request's draws depend on its seed and its own progress only (device_sampling.py), so this samples
    the tokens adding them all at once does."""
    ids: list[Any] = []
    later = []
    for prompt, seed in zip(prompts, seeds, strict=True):
        for j in range(group_size):
            params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + j, logprobs=0)
            if j == 0:
                ids.append(engine.add_request(prompt, params))
            else:
                later.append((len(ids), prompt, params))
                ids.append(None)
    done: dict[str, Any] = {}
    _step(engine, done)
    for i, prompt, params in later:
        ids[i] = engine.add_request(prompt, params)
    while len(done) < len(ids):
        _step(engine, done)
    failed = [o for o in done.values() if o.finish_reason == "error"]
    if failed:
        raise TrainingError(f"the serving engine failed a GRPO rollout: {failed[0].error}")
    return [done[rid] for rid in ids]


def _step(engine: LLMEngine, done: dict[str, Any]) -> None:
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out
