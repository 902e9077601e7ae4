"""The driver's side of a step: from the scheduler's plan to each request's new tokens.

`execute` lets the proposer draft tokens for the decoding sequences that may speculate, runs the
forward over the packed batch (`PagedForward`: on every rank under tensor parallelism), then works
on the logits rows each completing request samples from: their finiteness is checked, the rows of
requests under a JSON schema are masked (`structured_output.mask_logits`), requests without drafts
sample on the device (`device_sampling`) and greedy requests with drafts take the argmax of their
rows; sampled tokens, argmaxes and finiteness flags come to the host in one transfer
(`HostTransfer`). Where the logits are on the CPU and every request takes its one row's argmax with
nothing changing or reading its logits (a plain greedy decode step), the one-pass checks' finiteness
and argmax are read as they are instead (`_greedy_on_host`): the same answer in fewer operations.
Greedy drafts are verified against those argmaxes, sampled drafts against their
rows on the host (`rejection_sampling`). Each completing request gets one `SampledTokens`: its new
tokens, or the error that fails it alone.

A hybrid model's items carry their request's recurrent-state slot (`StateSlots`: taken the first
step a request runs, given back when the plan releases it); after drafts are verified, each slot
keeps the state after its accepted tokens (`PagedModel.keep_verified`).

`score` runs given tokens and returns the log-probabilities of given targets (perplexity);
`score_targets` also says whether each target is its row's argmax (what lm-eval's `is_greedy` is).
"""

from __future__ import annotations

import torch

from tessera.infer.cpu.gguf_layer import logit_checks
from tessera.infer.engine.sequence import Sequence
from tessera.infer.engine.step_outputs import (
    PromptLogprobs,
    RunnerOutput,
    SampledTokens,
    ScheduledSequence,
    SchedulerOutput,
    ScoringChunk,
    TargetScores,
)
from tessera.infer.runner.multimodal import spans_in
from tessera.infer.runner.paged_model import BatchItem, PagedForward
from tessera.infer.runner.rejection_sampling import verify_greedy, verify_sampled
from tessera.infer.runner.speculative import Proposal, Proposer
from tessera.infer.sampling.device_sampling import HostTransfer, SamplingBatch, sample_on_device
from tessera.infer.sampling.logprobs import LogprobRows, add_logprobs, raw_logprobs, read_logprobs
from tessera.infer.sampling.penalties import apply_penalties, changes_logits
from tessera.infer.sampling.sampler import processed_probs
from tessera.infer.sampling.structured_output import mask_logits
from tessera.infer.scheduling.recurrent_state import StateSlots
from tessera.infer.scheduling.state_snapshots import StateSnapshots


class ModelRunner:
    """Drives `paged` (this process's model, or every rank's) on the driver; `proposer` drafts
    speculative tokens (None: no speculative decoding)."""

    def __init__(self, paged: PagedForward, proposer: Proposer | None = None, slots: StateSlots | None = None,
                 snapshots: StateSnapshots | None = None):
        self.paged, self.proposer = paged, proposer
        self.slots = slots  # a hybrid model's recurrent-state slots by request (recurrent_state.py)
        self.snapshots = snapshots  # ... and their prefix-cache snapshots by block (state_snapshots.py)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """The new tokens of every request of `plan` whose step completes."""
        if self.proposer is not None:
            for request_id in plan.released:
                self.proposer.release(request_id)
        if self.slots is not None:
            self.slots.release(plan.released)
        if not plan.scheduled:
            return RunnerOutput({})
        proposals = self._propose(plan.scheduled)
        items = [_batch_item(s, proposals.get(s.seq.request_id)) for s in plan.scheduled]
        if self.slots is not None:
            for s, it in zip(plan.scheduled, items):
                self._take_slot(s, it)
        logits_TV, offsets = self.paged.forward_split(items)
        self._observe(plan.scheduled, items, offsets)
        # rows each completing request samples from: its last computed position (and its drafts)
        rows = {s.seq.request_id: range(o + s.num_tokens - 1, o + len(it.tokens))
                for s, it, o in zip(plan.scheduled, items, offsets) if s.completes}
        completing = [s for s in plan.scheduled if s.completes]
        prompt_asks = _prompt_asks(plan.scheduled, offsets)
        host = _to_host(logits_TV, [s.seq for s in completing], rows, proposals, prompt_asks)
        scored = {ask.key[1]: PromptLogprobs(first, read_logprobs(host, ask, host["top_k"]))
                  for ask, first, _ in prompt_asks}
        sampled = {s.seq.request_id: self._sampled(s, logits_TV, rows[s.seq.request_id], host,
                                                   proposals.get(s.seq.request_id)) for s in completing}
        if self.slots is not None and proposals:  # each slot keeps the state of its verified tokens
            self.paged.keep_verified({it.state_slot: s.num_tokens + len(sampled[s.seq.request_id].token_ids) - 1
                                      for s, it in zip(plan.scheduled, items)
                                      if it.drafts and not sampled[s.seq.request_id].error})
        return RunnerOutput(sampled, scored)

    def _take_slot(self, s: ScheduledSequence, it: BatchItem) -> None:
        """`it`'s recurrent-state slot; with prefix caching, the snapshot a sequence that adopted a
        cached prefix starts from, and those its final tokens complete blocks for."""
        fresh = s.seq.request_id not in self.slots.owner
        it.state_slot = self.slots.slot(s.seq.request_id)
        if self.snapshots is None:
            return
        if fresh and it.start > 0:
            it.state_from = self.snapshots.restore_from(it.block_table, it.start)
        if not it.drafts:
            it.snapshots = self.snapshots.plan_item(it.block_table, it.start, len(it.tokens))

    def _propose(self, scheduled: list[ScheduledSequence]) -> dict[str, Proposal]:
        spec = [s for s in scheduled if s.draft_limit > 0]
        if not spec or self.proposer is None:
            return {}
        proposals = self.proposer.propose([s.seq for s in spec], [s.draft_limit for s in spec])
        return {s.seq.request_id: p for s, p in zip(spec, proposals) if p.tokens}

    def _observe(self, scheduled: list[ScheduledSequence], items: list[BatchItem], offsets: list[int]) -> None:
        """Hand a proposer that drafts from the target's hidden states (mtp_proposer.py) each
        request's rows of this step's forward."""
        observe = getattr(self.proposer, "observe", None)
        if observe is None:
            return
        hidden_TD = self.paged.hidden
        for s, it, o in zip(scheduled, items, offsets, strict=True):
            observe(s.seq.request_id, it.start, hidden_TD[o:o + len(it.tokens)].clone())

    def _sampled(self, s: ScheduledSequence, logits_TV: torch.Tensor, rows: range, host: dict,
                 proposal: Proposal | None) -> SampledTokens:
        """One request's new tokens from the step's transfer `host`: its sampled token, or its drafts
        verified against its `rows` of the logits (the proposer then forgets the rejected ones)."""
        seq = s.seq
        rid = seq.request_id
        if not all(host[("finite", rid)]):
            return SampledTokens([], FloatingPointError("the model produced inf/NaN logits for this request"))
        if proposal is None:
            if seq.params.logprobs is None:
                return SampledTokens(host[("token", rid)])
            ask = LogprobRows(("sampled", rid), [rows.stop - 1], seq.params.logprobs)
            return SampledTokens(host[("token", rid)], logprobs=read_logprobs(host, ask, host["top_k"]))
        try:
            if seq.params.greedy:
                new = verify_greedy(host[("argmax", rid)], proposal.tokens)
            else:
                new = verify_sampled(processed_probs(logits_TV[rows.start:rows.stop], seq.params), proposal.tokens,
                                     proposal.probs, seq.generator)
        except Exception as e:  # this request's numbers went wrong: it alone fails
            return SampledTokens([], e)
        self.proposer.rollback(rid, seq.num_computed + s.num_tokens + len(new) - 1)
        return SampledTokens(new, num_draft_tokens=len(proposal.tokens))

    def score(self, chunks: list[ScoringChunk]) -> list[torch.Tensor]:
        """fp32 log-probabilities [len(targets)] of each chunk's targets, on the logits' device. The
        chunks run packed in one forward (never the static-shape decode step)."""
        return [s.logprobs for s in self.score_targets(chunks)]

    def score_targets(self, chunks: list[ScoringChunk]) -> list[TargetScores]:
        """`score`, and for each target whether it is its row's argmax."""
        logits_TV = self.paged.forward([BatchItem(c.tokens, c.start, c.block_table, window_table=c.window_table)
                                       for c in chunks]).float()
        out, row = [], 0
        for c in chunks:
            logp = torch.log_softmax(logits_TV[row:row + len(c.targets)], dim=-1)
            targets = torch.tensor(c.targets, dtype=torch.long, device=logp.device)
            out.append(TargetScores(logp.gather(1, targets[:, None])[:, 0], logp.argmax(-1) == targets))
            row += len(c.tokens)
        return out


def _batch_item(s: ScheduledSequence, proposal: Proposal | None) -> BatchItem:
    """The tokens `s` computes this step (its drafts after them), and the rows read afterwards."""
    seq = s.seq
    tokens = seq.token_ids[seq.num_computed:seq.num_computed + s.num_tokens]
    if proposal is not None:
        tokens = tokens + proposal.tokens
    read_from = s.num_tokens - 1 if s.completes else len(tokens)
    if seq.wants_prompt_logprobs:
        read_from = 0
    images = spans_in(seq.images, seq.num_computed, s.num_tokens) if seq.images else []
    mrope = seq.images if seq.images and seq.images[0].grid is not None else ()
    return BatchItem(tokens, seq.num_computed, seq.block_table, seq.adapter_slot, read_from, images, mrope,
                     seq.window_table or None, drafts=len(proposal.tokens) if proposal is not None else 0)


def _prompt_asks(scheduled: list[ScheduledSequence], offsets: list[int]) -> list[tuple[LogprobRows, int, list[int]]]:
    """For each sequence whose chunk computes prompt positions whose next prompt token's
    log-probability is asked: (its rows, the first position scored, the prompt tokens scored)."""
    out = []
    for s, o in zip(scheduled, offsets):
        seq = s.seq
        if not seq.wants_prompt_logprobs:
            continue
        c = seq.num_computed
        m = min(c + s.num_tokens, seq.num_prompt - 1) - c  # rows whose next token is a prompt token
        if m > 0:
            ask = LogprobRows(("prompt", seq.request_id), list(range(o, o + m)), seq.params.prompt_logprobs)
            out.append((ask, c + 1, seq.token_ids[c + 1:c + 1 + m]))
    return out


def _to_host(logits_TV: torch.Tensor, seqs: list[Sequence], rows: dict[str, range],
             proposals: dict[str, Proposal], prompt_asks: list[tuple[LogprobRows, int, list[int]]]) -> dict:
    """The step's one device -> host transfer, by key: ("token", request) the sampled token of each
    request without drafts, ("argmax", request) the argmax of every row of each greedy request with
    drafts, ("finite", request) whether each of a request's rows is finite, and the log-probabilities
    asked (`logprobs.add_logprobs`; "top_k": how many top tokens each row brought). The finiteness
    and the log-probabilities are of the raw logits, before the grammar masks put -inf in and before
    biases and penalties."""
    host = _greedy_on_host(logits_TV, seqs, rows, proposals, prompt_asks)
    if host is not None:
        return host
    transfer = HostTransfer()
    finite_keys = [("finite", s.request_id) for s in seqs for _ in rows[s.request_id]]
    finite_R, argmax_R = _finite_rows(logits_TV, [r for s in seqs for r in rows[s.request_id]])
    plain = [s for s in seqs if s.request_id not in proposals]
    pick = [j for j, s in enumerate(plain) if s.params.logprobs is not None]
    asks = [LogprobRows(("sampled", plain[j].request_id), [rows[plain[j].request_id][-1]], plain[j].params.logprobs)
            for j in pick] + [a for a, _, _ in prompt_asks]
    logp_RV = raw_logprobs(logits_TV, asks)
    constrained = [s for s in seqs if s.grammar is not None]
    mask_logits(logits_TV, [rows[s.request_id][0] for s in constrained], [s.grammar for s in constrained])
    tokens_B = None
    if plain and argmax_R is not None and not constrained and all(s.params.greedy for s in plain) \
            and not changes_logits(plain):  # the one-pass checks' argmax is the greedy token: no second pass
        at, n = {}, 0
        for s in seqs:
            n += len(rows[s.request_id])
            at[s.request_id] = n - 1
        tokens_B = argmax_R[[at[s.request_id] for s in plain]]
        transfer.add(tokens_B, [("token", s.request_id) for s in plain])
    elif plain:
        index = torch.tensor([rows[s.request_id][-1] for s in plain]).to(logits_TV.device, non_blocking=True)
        batch = SamplingBatch.build([(s.params, s.seed, len(s.output_ids)) for s in plain], logits_TV.shape[-1],
                                    logits_TV.device)
        logits_BV = logits_TV.index_select(0, index)
        if changes_logits(plain):
            logits_BV = apply_penalties(logits_BV, plain)
        tokens_B = sample_on_device(logits_BV, batch)
        transfer.add(tokens_B, [("token", s.request_id) for s in plain])
    greedy = [s for s in seqs if s.request_id in proposals and s.params.greedy]
    if greedy:
        index = torch.tensor([r for s in greedy for r in rows[s.request_id]]).to(logits_TV.device, non_blocking=True)
        transfer.add(logits_TV.index_select(0, index).argmax(-1),
                     [("argmax", s.request_id) for s in greedy for _ in rows[s.request_id]])
    top_k = 0
    if asks:
        parts = [tokens_B[pick]] if pick else []
        parts += [torch.tensor(t, dtype=torch.long) for _, _, t in prompt_asks]
        chosen_R = torch.cat([p.to(logits_TV.device) for p in parts])
        top_k = add_logprobs(transfer, logp_RV, asks, chosen_R)
    transfer.add(finite_R, finite_keys)
    host = transfer.fetch()
    host["top_k"] = top_k
    return host


def _greedy_on_host(logits_TV: torch.Tensor, seqs: list[Sequence], rows: dict[str, range],
                    proposals: dict[str, Proposal], prompt_asks: list) -> dict | None:
    """`_to_host`'s answer where the logits are on the CPU and every request takes the argmax of its one
    row, nothing changing or reading its logits (greedy, no drafts, grammar, penalties, biases, logprobs
    or prompt logprobs): each row's finiteness and argmax from the one-pass checks (`logit_checks`), read
    as they are, without the transfer's gathering: what `_to_host` answers then, in fewer operations (a
    batch-1 decode step's). None elsewhere, or where the checks do not serve."""
    if (not seqs or logits_TV.device.type != "cpu" or proposals or prompt_asks or changes_logits(seqs)
            or any(s.grammar is not None or s.params.logprobs is not None or not s.params.greedy for s in seqs)):
        return None
    checks = logit_checks(logits_TV, torch.tensor([rows[s.request_id][-1] for s in seqs]))
    if checks is None:
        return None
    finite_R, argmax_R = torch.stack(checks).tolist()  # the step's one transfer
    host: dict = {"top_k": 0}
    for s, finite, token in zip(seqs, finite_R, argmax_R, strict=True):
        host[("finite", s.request_id)], host[("token", s.request_id)] = [finite], [token]
    return host


def _finite_rows(logits_TV: torch.Tensor, index: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[R] int64 on the device, 1 where logits row index[r] is finite; and each row's argmax where the
    CPU kernel checked them in one pass (infer/cpu/gguf_layer.py's `logit_checks`), else None."""
    if not index:
        return logits_TV.new_zeros(0, dtype=torch.long), None
    rows = torch.tensor(index).to(logits_TV.device, non_blocking=True)
    checks = logit_checks(logits_TV, rows)
    if checks is not None:
        return checks
    return torch.isfinite(logits_TV.index_select(0, rows)).all(-1).long(), None
