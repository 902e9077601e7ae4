"""Proposers for speculative decoding: where the k guessed tokens come from.

- `PromptLookupProposer` (prompt lookup decoding, Saxena 2023; "n-gram" speculation): find the
  latest earlier occurrence of the context's last n tokens (n from ngram_max down to ngram_min)
  and propose the tokens that followed it. Costs no model call; pays off on text that repeats
  its context (code edits, quoting, extraction, loops).
- `MTPProposer` (mtp_proposer.py): the target's own multi-token-prediction module drafts from
  the target's hidden states (DeepSeek-V3's MTP, and V3.2's with its sparse attention; `model.mtp_depth`).
- `EagleProposer` (eagle_proposer.py): an EAGLE-3 draft head drafts from the target's hidden
  states of a low, a middle and a high layer (`--speculative eagle --draft-model DIR`).
- `DraftModelProposer`: a small model with the same vocabulary proposes k tokens autoregressively
  (Leviathan et al. 2023). It keeps its own paged KV cache; each call first catches up on the
  tokens the target accepted since the last call, in one packed forward pass.

Either way the model runner verifies the proposals with one forward pass of the target
(`rejection_sampling.py`). A proposer keeps what it needs per request (a draft KV cache) until
the runner tells it the request is gone (`release`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tessera.checkpoint.eagle_dir import load_eagle_draft
from tessera.checkpoint.loading import load_model
from tessera.config.errors import ConfigError
from tessera.infer.config import EngineConfig
from tessera.infer.engine.sequence import Sequence
from tessera.infer.runner.draft_tokens import Proposal, draw_tokens
from tessera.infer.runner.eagle_proposer import EagleProposer
from tessera.infer.runner.mtp_proposer import MTPProposer
from tessera.infer.runner.paged_model import BatchItem, PagedModel
from tessera.infer.scheduling.block_manager import BlockManager
from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.infer.scheduling.recurrent_state import is_hybrid
from tessera.models.transformer import Transformer


def ngram_lookup(tokens: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix n-gram:
    the latest occurrence followed by k tokens, else the one followed by the most (in text with
    a short period the latest match sits right before the end and is followed by few tokens)."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = len(arr)
    for n in range(ngram_max, ngram_min - 1, -1):
        if L < n + 1:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= L]
            i = int(full[-1]) if len(full) else int(hits[0])
            return arr[i + n:i + n + k].tolist()
    return []


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Proposal]:
        """Up to `limits[i]` guessed tokens to follow `seqs[i]` (none where the limit is 0)."""

    def rollback(self, request_id: str, num_kept: int) -> None:
        """The target kept the first `num_kept` tokens of the request: forget what lies past them."""

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: drop what is kept for it."""


class PromptLookupProposer:
    def __init__(self, num_tokens: int, ngram_max: int = 3, ngram_min: int = 1):
        self.k, self.ngram_max, self.ngram_min = num_tokens, ngram_max, ngram_min

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Proposal]:
        return [Proposal(ngram_lookup(s.token_ids, min(self.k, lim), self.ngram_max, self.ngram_min)
                         if lim > 0 else []) for s, lim in zip(seqs, limits)]

    def rollback(self, request_id: str, num_kept: int) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


@dataclass
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # unused: the draft cache has no prefix reuse


class DraftModelProposer:
    def __init__(self, model: Transformer, target_vocab: int, num_tokens: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        if model.cfg.vocab_size != target_vocab:
            raise ConfigError(f"speculative.draft_model has vocab_size={model.cfg.vocab_size}, the target "
                              f"{target_vocab}; a draft model must share the target's tokenizer")
        self.k = num_tokens
        self.kv = PagedKVCache(model.cfg, num_blocks, block_size, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.paged = PagedModel(model, self.kv, device)
        self.state: dict[str, _DraftState] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Proposal]:
        proposals = [Proposal() for _ in seqs]
        active = []
        for i, (seq, lim) in enumerate(zip(seqs, limits)):
            if lim <= 0:
                continue
            st = self.state.setdefault(seq.request_id, _DraftState())
            if not self.blocks.ensure_slots(st, len(seq.token_ids) + lim - 1):
                continue  # the draft cache is full: this sequence decodes without speculation now
            active.append((i, seq, st, lim))
        if not active:
            return proposals
        # catch up on every token the draft has not seen, and draft the first token
        items = [BatchItem(seq.token_ids[st.num_computed:], st.num_computed, st.block_table)
                 for _, seq, st, _ in active]
        logits = self.paged.forward(items)
        ends = np.cumsum([len(it.tokens) for it in items]) - 1
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, *_ in active}
        drawn = draw_tokens([seq for _, seq, _, _ in active], logits[ends.tolist()])
        for (i, seq, st, _), (tok, q) in zip(active, drawn):
            st.num_computed = len(seq.token_ids)
            proposals[i].tokens.append(tok)
            if q is not None:
                probs[i].append(q)
        # then one token per step for the ones that want more
        for j in range(1, max(lim for *_, lim in active)):
            step = [(i, seq, st) for i, seq, st, lim in active if lim > j]
            items = [BatchItem([proposals[i].tokens[-1]], st.num_computed, st.block_table) for i, _, st in step]
            logits = self.paged.forward(items)
            for (i, _, st), (tok, q) in zip(step, draw_tokens([seq for _, seq, _ in step], logits)):
                st.num_computed += 1
                proposals[i].tokens.append(tok)
                if q is not None:
                    probs[i].append(q)
        for i, qs in probs.items():
            if qs:
                proposals[i].probs = torch.stack(qs)
        return proposals

    def rollback(self, request_id: str, num_kept: int) -> None:
        """Forget draft keys/values past what the target kept (rejected proposals)."""
        st = self.state.get(request_id)
        if st is not None:
            st.num_computed = min(st.num_computed, num_kept)

    def release(self, request_id: str) -> None:
        st = self.state.pop(request_id, None)
        if st is not None:
            self.blocks.free_sequence(st)


def build_proposer(config: EngineConfig, target_vocab: int, num_blocks: int,
                   target: PagedModel | None = None) -> Proposer | None:
    """The proposer `config.speculative` asks for (None without speculative decoding); a draft
    model is loaded from its directory, with a cache of `num_blocks` blocks like the target's;
    "mtp" drafts with `target`'s own multi-token-prediction module (mtp_proposer.py) and "eagle" with
    an EAGLE-3 head read from `draft_model` (eagle_proposer.py), both from the hidden states of
    `target`'s forward passes, which `target` then keeps (`PagedModel.keep_hidden`)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "prompt_lookup":
        return PromptLookupProposer(spec.num_tokens, spec.ngram_max, spec.ngram_min)
    dtype = config.torch_dtype
    if spec.method in ("mtp", "eagle"):
        if target is None:
            raise ConfigError(f"speculative.method={spec.method!r} drafts from the served model in this process; "
                              "it is not available here (tensor_parallel_size > 1)")
        if spec.method == "mtp":
            proposer = MTPProposer(target.model, spec.num_tokens, num_blocks, config.block_size, dtype, config.device)
        else:
            draft = load_eagle_draft(spec.draft_model, target.model.cfg, dtype, config.device)
            proposer = EagleProposer(target.model, draft, spec.num_tokens, num_blocks, config.block_size, dtype,
                                     config.device)
        target.keep_hidden = proposer.hidden_layers
        return proposer
    draft = load_model(spec.draft_model, dtype, config.device).model
    if is_hybrid(draft.cfg):
        raise ConfigError(f"speculative.draft_model is a hybrid model (model.family={draft.cfg.family}); a draft "
                          "model's cache holds attention keys and values only: draft with an attention-only model")
    return DraftModelProposer(draft.eval(), target_vocab, spec.num_tokens, num_blocks, config.block_size, dtype,
                              config.device)
