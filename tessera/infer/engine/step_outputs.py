"""What the parts of one engine step hand each other.

A step (`LLMEngine.step`) is three calls:

    plan = scheduler.schedule()                          # SchedulerOutput: what runs, how many tokens each
    result = executor.execute_model(plan)                # RunnerOutput: each completing request's new tokens
    update = scheduler.update_from_output(plan, result)  # SchedulerUpdate: one RequestOutput per request

and the executor then zeroes, on every rank, the KV blocks of requests that failed on inf/NaN
(`scheduler.take_dirty_blocks()`), also when applying the results raised.

- The scheduler (`scheduler.py`) owns the requests, the waiting queue, the running batch and the
  block manager. `schedule()` picks the sequences of the step under the token budget (chunked
  prefill, admission, preemption) and how many tokens each may draft. `update_from_output()` advances
  grammars, appends the new tokens until a stop rule fires (`output_processor.py` turns them into
  text and `RequestOutput`s), finishes requests and frees their blocks, names the computed full
  blocks in the prefix cache, fails a request alone when its tokens came with an error, and counts
  the metrics.
- The executor (`executor.py`: one process, `tp_executor.py`: tensor parallelism) owns the model on
  every rank, its KV cache, its LoRA adapters and, under tensor parallelism, the worker processes.
- The model runner (`model_runner.py`) runs on the driver (rank 0): it drafts (speculative
  decoding), runs the forward on every rank, masks the logits of requests under a grammar, samples on
  the device, verifies drafts, checks finiteness and hands back one `SampledTokens` per completing
  request, with one device -> host transfer per step. It also scores given targets
  (`ScoringChunk`: perplexity; `TargetScores`: with whether each target is the argmax, for
  evaluation harnesses).
  Requests that ask log-probabilities get them with their tokens (`SampledTokens.logprobs`, and
  `RunnerOutput.prompt_logprobs` from their prefill chunks); biases and penalties are applied to a
  request's row before it samples (`penalties.py`). Such requests decode one token per step.

Request ids key the hand-offs: a request is running at most once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tessera.infer.engine.sequence import RequestOutput, Sequence
from tessera.infer.sampling.logprobs import TokenLogprobs

if TYPE_CHECKING:
    import torch

    from tessera.infer.scheduling.kv_tiers import KVTransfers


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens of seq.token_ids computed this step, from seq.num_computed
    draft_limit: int = 0  # at most this many speculative tokens may follow them (a decode step only)

    @property
    def completes(self) -> bool:
        """After this step every token has keys/values: the step samples the next token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    # requests finished or preempted since the last plan: state kept for them beside the scheduler
    # (a draft model's KV blocks) goes
    released: list[str] = field(default_factory=list)
    # copies between the device's KV blocks and the host / disk tiers, made before the forward
    kv: KVTransfers | None = None


@dataclass
class SampledTokens:
    """What the step produced for one request whose tokens all have keys/values now."""

    token_ids: list[int]  # the sampled token, or the accepted drafts and the token after them
    error: Exception | None = None  # set (and token_ids empty) when this request alone fails: inf/NaN logits
    num_draft_tokens: int = 0  # speculative tokens verified this step (0: none were proposed)
    logprobs: list[TokenLogprobs] | None = None  # of each token of token_ids, when the request asks them


@dataclass
class PromptLogprobs:
    """The log-probabilities of prompt tokens first.. (positions) that a prefill chunk computed."""

    first: int  # position of the first token scored (>= 1: the first prompt token has none)
    entries: list[TokenLogprobs]


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledTokens]  # by request id: the requests of the plan whose step completes
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # by request id: chunks that scored


@dataclass
class SchedulerUpdate:
    outputs: list[RequestOutput]  # one per request that produced tokens or finished this step


@dataclass
class ScoringChunk:
    """Tokens to run at positions start.. on cache blocks `block_table`, and the token expected after
    each of the first len(targets) of them: their log-probabilities are scored."""

    tokens: list[int]
    start: int
    block_table: list[int]
    targets: list[int]
    window_table: list[int] | None = None  # the windowed layers' blocks, where the cache has a windowed pool


@dataclass
class TargetScores:
    """What `score_targets` gives for one `ScoringChunk`, on the logits' device."""

    logprobs: torch.Tensor  # [len(targets)] fp32 log-probability of each target
    is_argmax: torch.Tensor  # [len(targets)] bool: the target is its row's argmax (the first, on ties)
