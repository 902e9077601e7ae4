"""Continuous batching: which sequences run in the next step and how many tokens each, then what
their results do to them.

Every step has a token budget (`max_num_batched_tokens`). Running sequences come first, in
arrival order: a decoding sequence costs 1 token (plus `lookahead` speculative slots), a prompt
still being prefilled gets the next chunk that fits (chunked prefill). Waiting requests are then
admitted in queue order while budget, sequence slots and KV blocks last; a prompt whose leading
blocks are in the prefix cache starts past them.

The queue order (`policy`): "fcfs" (the default, as vLLM's) is arrival order. "shortest_first" is
arrival order between steps and, among the requests that arrived since the previous step (which the
engine sees at the same moment), the shortest prompt first: a burst of prompts is prefilled shortest
first, which lowers the median time to first token, at the price of the time per output token of the
requests that then decode inside the longer prompts' prefill steps and of some of the throughput
served: a trade, not a gain (docs/benchmarks.md, "`--scheduling-policy shortest_first` vs `fcfs`").
No request waits behind one that arrived after a step it could have been admitted in.

When a running sequence needs a block and none is left, the most recently arrived running
sequence is preempted: its blocks are released (they stay in the prefix cache while nobody
needs the space) and it goes back to the front of the queue, to be recomputed from its prompt
and the tokens it has produced so far (recompute preemption, as in vLLM).

After the step (`update_from_output`) each sequence that sampled advances its grammar, appends its
tokens until a stop rule fires (`output_processor.py`) and finishes or goes on; the full blocks
it computed are named in the prefix cache (with a windowed pool, with their window blocks, and the
kept blocks a sequence's ring turned away from are given back once no later query sees them:
window_blocks.py). A request whose tokens
came with an error (inf/NaN logits), or whose grammar refuses them, fails alone: the rest of the batch
carries on.
"""

from __future__ import annotations

import logging
import sys
from collections import deque

from tessera.infer.config import SCHEDULING_POLICIES as POLICIES
from tessera.infer.engine.metrics import EngineMetrics
from tessera.infer.engine.output_processor import OutputProcessor
from tessera.infer.engine.sequence import RequestOutput, Sequence, SequenceStatus
from tessera.infer.engine.step_outputs import (
    PromptLogprobs,
    RunnerOutput,
    SampledTokens,
    ScheduledSequence,
    SchedulerOutput,
    SchedulerUpdate,
)
from tessera.infer.sampling.response_format import GrammarError
from tessera.infer.sampling.structured_output import GrammarMatcher
from tessera.infer.scheduling.block_manager import BlockManager
from tessera.infer.scheduling.kv_tiers import KVTransfers

log = logging.getLogger("tessera.infer")


class Scheduler:
    """The requests of the engine, from `add` to their last `RequestOutput`: the waiting queue, the
    running batch and their KV blocks. `outputs` turns tokens into text and counts the metrics (one
    without a tokenizer or a length limit when not given)."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, lookahead: int = 0,
                 outputs: OutputProcessor | None = None, policy: str = "fcfs"):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.lookahead = lookahead
        self.outputs = outputs or OutputProcessor(None, sys.maxsize, EngineMetrics())
        self.metrics = self.outputs.metrics
        self.requests: dict[str, Sequence] = {}  # every request not finished yet, waiting or running
        self.waiting: deque[Sequence] = deque()
        self._arrived = 0  # the last this many of `waiting` arrived since the previous plan
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Admitting a new request keeps this many blocks free for the running ones to grow into.
        self.watermark = max(1, blocks.num_blocks // 100)
        self._released: list[str] = []  # finished since the last plan
        # KV blocks freed by requests that failed on inf/NaN, not zeroed yet (`take_dirty_blocks`)
        self._dirty_blocks: list[int] = []

    # ---- requests in and out -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.outputs.add(seq)
        self.metrics.prompt_tokens += len(seq.prompt_ids)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._arrived += 1

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            at = self.waiting.index(seq)
            if at >= len(self.waiting) - self._arrived:  # one of the arrivals since the last plan
                self._arrived -= 1
            del self.waiting[at]
        self.blocks.free_sequence(seq)

    def finish(self, seq: Sequence, reason: str, appended: list[int], error: str | None = None,
               client_error: bool = False) -> RequestOutput:
        """End `seq` with `reason` ("stop", "length", "abort" or "error"); its last output. A system
        prompt's full blocks are pinned in the prefix cache first."""
        if seq.pin_prefix:
            self.blocks.register_computed(seq)
            self.blocks.pin_sequence(seq)
        self.remove(seq)
        self._released.append(seq.request_id)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self.requests[seq.request_id]
        return self.outputs.finished(seq, appended, error, client_error)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        return None if seq is None else self.finish(seq, "abort", [])

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with an error (at shutdown)."""
        return [self.finish(seq, "error", [], message) for seq in list(self.requests.values())]

    def fail_running(self, message: str) -> list[RequestOutput]:
        """After an exception inside a step that no single request can be blamed for (the batch's
        forward pass): finish the requests that were running with an error; the waiting ones
        have not been touched and stay queued. Fails every request if none was running, so a
        failure while admitting cannot repeat forever."""
        running = list(self.running)
        if not running:
            return self.fail_all(message)
        return [self.finish(seq, "error", [], message) for seq in running]

    # ---- the plan of a step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._order_arrivals()
        out = SchedulerOutput([], [])
        budget = self._schedule_running(out)
        self._admit_waiting(out, budget)
        out.released = self._released + [victim.request_id for victim in out.preempted]
        self._released = []
        out.kv = self.take_kv_transfers()
        return out

    def _order_arrivals(self) -> None:
        """Under "shortest_first", the requests that arrived since the previous plan (the end of the
        queue) shortest prompt first, ties in arrival order."""
        n, self._arrived = self._arrived, 0
        if self.policy != "shortest_first" or n < 2:
            return
        arrived = [self.waiting.pop() for _ in range(n)][::-1]
        arrived.sort(key=lambda seq: len(seq.token_ids))
        self.waiting.extend(arrived)

    def take_kv_transfers(self) -> KVTransfers | None:
        """The copies between KV tiers planned since the last call (None without tiers)."""
        return self.blocks.tiers.take() if self.blocks.tiers is not None else None

    def _draft_limit(self, seq: Sequence) -> int:
        """Speculative tokens `seq` may verify this step: not past max_tokens or max_model_len. A
        request with a grammar decodes one token per step (drafts would go unmasked), and so does one
        whose logits are biased or penalised or whose log-probabilities are asked."""
        if seq.grammar is not None or seq.params.decodes_singly:
            return 0
        remaining = seq.params.max_tokens - len(seq.output_ids) - 1
        return max(0, min(self.lookahead, remaining, self.outputs.max_model_len - len(seq.token_ids) - 1))

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.blocks.free_sequence(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.metrics.preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Running sequences, oldest first; the newest are the preemption victims. Returns the
        budget left."""
        budget, i = self.budget, 0
        while i < len(self.running):
            seq = self.running[i]
            decoding = seq.is_decoding
            extra = self.lookahead if decoding else 0
            n = min(seq.num_uncomputed, budget - extra)
            if n <= 0:
                i += 1
                continue
            while not self.blocks.ensure_slots(seq, seq.num_computed + n + extra):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:  # it preempted itself
                continue
            out.scheduled.append(ScheduledSequence(seq, n, self._draft_limit(seq) if decoding and extra > 0 else 0))
            budget -= n + extra
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting requests, first come first served, while budget, slots and blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if out.preempted and seq in out.preempted:  # preempted this very step: do not bring it straight back
                break
            hit, hashes = self.blocks.find_prefix(seq)
            if seq.wants_prompt_logprobs:  # every prompt position must run to be scored
                hit, below = [], []
            else:
                below = self.blocks.find_below(hashes, len(hit))
            start = (len(hit) + len(below)) * self.blocks.block_size
            n = min(len(seq.token_ids) - start, budget)
            need = self.blocks.blocks_for(start + n) - len(hit)
            reserve = self.watermark if self.running else 0
            if not self.blocks.can_allocate(need + reserve, hit):
                break
            self.waiting.popleft()
            self.blocks.adopt_prefix(seq, hit, hashes, below)
            self.blocks.ensure_slots(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n

    # ---- the results of a step -----------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, result: RunnerOutput) -> SchedulerUpdate:
        """Apply the step's results to its sequences, in the order of the plan (a request failing
        alone frees blocks that a later one's failure may then own alone)."""
        update = SchedulerUpdate([])
        if not plan.scheduled:
            if self.waiting and not self.running:  # the first in the queue cannot fit even alone
                update.outputs.append(self.finish(self.waiting[0], "error", [],
                                                  "the request needs more KV-cache blocks than exist"))
            return update
        self.metrics.steps += 1
        for s in plan.scheduled:
            seq = s.seq
            scored = result.prompt_logprobs.get(seq.request_id)
            if scored is not None:
                _record_prompt_logprobs(seq, scored)
            if not s.completes:
                seq.num_computed += s.num_tokens
            else:
                update.outputs.append(self._apply(s, result.sampled[seq.request_id]))
            if not seq.finished:
                self.blocks.register_computed(seq)
        return update

    def take_dirty_blocks(self) -> list[int]:
        """The KV blocks requests that failed on inf/NaN left since the last call, to be zeroed on
        every rank before a step can hand them to another request."""
        dirty, self._dirty_blocks = self._dirty_blocks, []
        return dirty

    def _apply(self, s: ScheduledSequence, sampled: SampledTokens) -> RequestOutput:
        """The new tokens of a sequence whose step completed: its grammar advanced, its tokens
        appended until a stop rule fires."""
        seq, new = s.seq, sampled.token_ids
        error = sampled.error or _advance(seq.grammar, new)
        if error is not None:
            return self._fail_alone(seq, error)
        seq.num_computed += s.num_tokens + len(new) - 1
        if sampled.num_draft_tokens:
            self.metrics.speculation(sampled.num_draft_tokens, len(new))
        appended, reason = self.outputs.append(seq, new)
        if sampled.logprobs is not None:  # of the tokens kept (those after a stop are dropped)
            seq.logprobs.extend(sampled.logprobs[:len(appended)])
        if reason:  # its full blocks are named first: a request ending in its prefill step leaves them too
            self.blocks.register_computed(seq)
            return self.finish(seq, reason, appended)
        return self.outputs.running(seq, appended)

    def _fail_alone(self, seq: Sequence, error: Exception) -> RequestOutput:
        """Finish one request whose numbers or grammar went wrong, leaving the rest of the batch
        running. A grammar failure is the request's own (its schema): its KV blocks are sound and
        stay as they are. Otherwise the KV blocks only it holds are left to be
        zeroed (`take_dirty_blocks`) (a stale inf/NaN slot would poison the next owner of the block, since attention
        multiplies even masked-out values by zero weight), and out of the prefix cache (a later
        prompt must recompute them, not reuse zeros)."""
        log.warning("request %s failed alone: %s: %s", seq.request_id, type(error).__name__, error)
        if isinstance(error, GrammarError):
            return self.finish(seq, "error", [], str(error), client_error=True)
        own = [b for b in seq.block_table if self.blocks.ref[b] == 1]
        self._dirty_blocks.extend(own)
        if self.blocks.window is not None:  # a windowed pool's block travels as -1 - b (PagedKVCache.clear_blocks)
            self._dirty_blocks.extend(-1 - b for b in self.blocks.window.spoiled(seq))
        if self.blocks.cache is not None:
            for b in own:
                self.blocks.forget(b)
        return self.finish(seq, "error", [], f"numerical error: {error}")


def _record_prompt_logprobs(seq: Sequence, scored: PromptLogprobs) -> None:
    """Keep the prompt log-probabilities of a chunk that `seq` has not recorded yet (a recomputed
    prefill scores positions again)."""
    for position, entry in enumerate(scored.entries, scored.first):
        if position - 1 == len(seq.prompt_logprobs):
            seq.prompt_logprobs.append(entry)


def _advance(grammar: GrammarMatcher | None, tokens: list[int]) -> Exception | None:
    """Feed `tokens` to a request's grammar; the exception if it refuses them."""
    if grammar is None:
        return None
    try:
        grammar.advance(tokens)
    except Exception as e:  # the request alone fails (GrammarError: its schema)
        return e
    return None
