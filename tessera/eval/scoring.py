"""Log-likelihoods of continuations on the serving engine: what lm-eval's `loglikelihood` asks.

A request is a token sequence (context, then continuation) and how many of its last tokens to
score. The model reads every token but the last; the rows that predict the continuation give
log p(continuation token | everything before it), summed, and whether each was the argmax (lm-eval's
`is_greedy`: the continuation is what greedy decoding would produce).

Requests run through the engine's executor (`Executor.score_targets`: on every rank under tensor
parallelism) over its paged KV cache, the way `infer/engine/perplexity.py` scores text: each request
borrows KV blocks for its length, and is fed in pieces so that one forward holds at most
`max_num_batched_tokens` tokens, several requests packed together; a piece after the first reads
the keys/values of the earlier ones back from the cache, as generation does. Pieces of context
carry no targets; the continuation's pieces carry them. Requests are admitted while blocks and
sequence slots last and leave as they finish, so a long request never holds up the short ones.
With a windowed block pool (infer/scheduling/window_blocks.py) a request takes its blocks piece by
piece instead, its windowed layers' blocks a ring of the window's that later pieces write over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.config.errors import ConfigError
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.engine.sequence import Sequence
from tessera.infer.engine.step_outputs import ScoringChunk
from tessera.infer.sampling.params import SamplingParams


@dataclass(frozen=True)
class ScoreRequest:
    tokens: list[int]  # context then continuation (at most max_model_len + 1 tokens)
    num_targets: int  # the last num_targets tokens are scored, each given every token before it


@dataclass
class _Running:
    index: int
    request: ScoreRequest
    seq: Sequence
    position: int = 0  # tokens of the input (tokens[:-1]) computed so far
    logprob: float = 0.0
    greedy: bool = True

    @property
    def inputs(self) -> int:
        return len(self.request.tokens) - 1

    @property
    def first_target_row(self) -> int:
        return self.inputs - self.request.num_targets


def check_request(req: ScoreRequest, max_model_len: int) -> None:
    if not 1 <= req.num_targets <= len(req.tokens) - 1:
        raise ConfigError(f"a scoring request needs 1..{len(req.tokens) - 1} targets (one token of context at "
                          f"least), got {req.num_targets}")
    if len(req.tokens) - 1 > max_model_len:
        raise ConfigError(f"a scoring request of {len(req.tokens)} tokens is longer than max_model_len + 1 = "
                          f"{max_model_len + 1}; truncate its context")


@torch.inference_mode()
def score_requests(engine: LLMEngine, requests: list[ScoreRequest]) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether every one of its tokens is the argmax)
    of each request, in order. The engine must be idle: scoring borrows its KV cache."""
    if engine.has_unfinished():
        raise RuntimeError("scoring needs an idle engine (it borrows the KV cache)")
    for req in requests:
        check_request(req, engine.max_model_len)
    budget = engine.config.max_num_batched_tokens
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    waiting = list(range(len(requests)))[::-1]  # popped from the end: first come first served
    running: list[_Running] = []
    try:
        while waiting or running:
            _admit(engine, requests, waiting, running)
            _score_round(engine, running, budget)
            for r in [r for r in running if r.position == r.inputs]:
                results[r.index] = (r.logprob, r.greedy)
                engine.blocks.free_sequence(r.seq)
                running.remove(r)
    finally:
        for r in running:
            engine.blocks.free_sequence(r.seq)
    return results  # type: ignore[return-value]


def _admit(engine: LLMEngine, requests: list[ScoreRequest], waiting: list[int], running: list[_Running]) -> None:
    """Start waiting requests while sequence slots and KV blocks last (one at least, when none runs)."""
    while waiting and len(running) < engine.config.max_num_seqs:
        i = waiting[-1]
        seq = Sequence(f"score-{i}", requests[i].tokens, SamplingParams(), None)
        upfront = len(requests[i].tokens) - 1
        if engine.blocks.window is not None:  # piece by piece (`_score_round`)
            upfront = min(upfront, engine.config.max_num_batched_tokens)
        if not engine.blocks.ensure_slots(seq, upfront, named=False):
            if not running:
                raise RuntimeError(f"the KV cache ({engine.blocks.num_free_blocks} free blocks) cannot hold one "
                                   f"request of {len(requests[i].tokens)} tokens; raise kv_cache_gib")
            return
        running.append(_Running(waiting.pop(), requests[i], seq))


def _score_round(engine: LLMEngine, running: list[_Running], budget: int) -> None:
    """One forward: the next piece of each running request, at most `budget` tokens in all. A piece
    ends where the continuation starts, so that only continuation pieces carry targets."""
    chunks, owners, left = [], [], budget
    for r in running:
        if left == 0:
            break
        stop = r.first_target_row if r.position < r.first_target_row else r.inputs
        end = min(stop, r.position + left)
        tokens = r.request.tokens
        targets = tokens[r.position + 1:end + 1] if r.position >= r.first_target_row else []
        if not engine.blocks.ensure_slots(r.seq, end, named=False):  # only a windowed pool's requests grow here
            raise RuntimeError(f"the KV cache's windowed pool cannot hold a piece of {end - r.position} tokens")
        chunks.append(ScoringChunk(tokens[r.position:end], r.position, r.seq.block_table, targets,
                                   r.seq.window_table or None))
        owners.append((r, end))
        left -= end - r.position
    engine.flush_kv_transfers()  # blocks `_admit` evicted reach their tier before the scoring overwrites them
    for (r, end), scores in zip(owners, engine.executor.score_targets(chunks)):
        if scores.logprobs.numel():
            r.logprob += float(scores.logprobs.double().sum())
            r.greedy = r.greedy and bool(scores.is_argmax.all())
        r.position = r.seq.num_computed = end
