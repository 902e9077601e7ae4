"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`). Running sequences come first, in
arrival order: a decoding sequence costs 1 token (plus `lookahead` speculative slots), a prompt
still being prefilled gets the next chunk that fits (chunked prefill). Waiting requests are then
admitted first come, first served while budget, sequence slots and KV blocks last; a prompt whose
leading blocks are in the prefix cache starts past them.

When a running sequence needs a block and none is left, the most recently arrived running
sequence is preempted: its blocks are released (they stay in the prefix cache while nobody
needs the space) and it goes back to the front of the queue, to be recomputed from its prompt
and the tokens it has produced so far (recompute preemption, as in vLLM).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tessera.infer.block_manager import BlockManager
from tessera.infer.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens of seq.token_ids computed this step, from seq.num_computed
    speculate: bool  # a decode step that may carry speculative tokens

    @property
    def completes(self) -> bool:
        """After this step every token has keys/values: the step samples the next token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, lookahead: int = 0):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Admitting a new request keeps this many blocks free for the running ones to grow into.
        self.watermark = max(1, blocks.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.blocks.free_sequence(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [])
        budget = self.budget
        # 1. running sequences, oldest first; the newest are the preemption victims
        i = 0
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
            out.scheduled.append(ScheduledSequence(seq, n, decoding and extra > 0))
            budget -= n + extra
            i += 1
        # 2. waiting requests, first come first served
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not out.preempted or seq not in out.preempted:
                hit, hashes = self.blocks.find_prefix(seq)
            else:  # preempted this very step: do not bring it straight back
                break
            start = len(hit) * self.blocks.block_size
            n = min(len(seq.token_ids) - start, budget)
            need = self.blocks.blocks_for(start + n) - len(hit)
            reserve = self.watermark if self.running else 0
            if not self.blocks.can_allocate(need + reserve, hit):
                break
            self.waiting.popleft()
            self.blocks.adopt_prefix(seq, hit, hashes)
            self.blocks.ensure_slots(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n, False))
            budget -= n
        return out
