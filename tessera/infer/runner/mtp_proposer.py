"""Speculative decoding with the target's own multi-token-prediction module (`--speculative mtp`;
DeepSeek-V3 section 2.2, tessera/models/mtp.py): the MTP module is the draft.

Depth 1 at position p takes the target's last hidden state h_p (before the final norm) and the
embedding of token p+1 and predicts token p+2. Drafting k tokens after a sequence of N tokens
(the target has computed positions 0..N-2, and holds their hidden states):

1. catch up: depth 1 runs over every position j the module has not seen up to N-2, with the
   target's h_j and the real token j+1, writing its own keys and values (its block has a paged KV
   cache of its own); the last row predicts token N, the first draft;
2. chain: each further draft runs depth 1 once more at the next position, with the drafted token
   and, in place of the target's hidden state there (not computed yet), the module's own output
   at the previous position. Depth 1 is reused for every draft, the way vLLM serves DeepSeek-V3's
   one MTP layer with k > 1; deeper modules of a model with mtp_depth > 1 are not used in serving.

Only positions with the target's hidden states are kept in the module's cache: drafts' keys and
values are overwritten by the next catch-up. DeepSeek-V3.2's MTP layer is a block of its family, sparse
attention with a lightning indexer of its own (tessera/models/attention_variants/sparse_mla.py): the
module's cache is shaped by the model's config, so it keeps that indexer's key of every position beside
the keys and values (`PagedKVCache.index_k`), and the catch-up picks each query's `index_topk` keys among
them as the module's forward over the whole sequence does (`OneLayerCache.attend_sparse`).

The target's hidden states come from the packed forward pass (`PagedModel.keep_hidden`), so MTP
drafting runs every decode in the packed step (no static-shape decode step, `EngineConfig` sees to
it). A request whose prompt started past cached prefix blocks has no hidden states for them and
decodes without drafts. Greedy drafts are argmaxes; sampled ones are drawn from the processed
distribution q of the module's logits, which rejection sampling needs (`rejection_sampling.py`), as
the draft model's are.

The bookkeeping (the target's hidden states per request, the catch-up, the chain, rollback) is
`HiddenStateProposer`'s, which the EAGLE proposer (eagle_proposer.py) shares; a subclass says how
its draft layer runs over packed rows (`_run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.infer.engine.sequence import Sequence
from tessera.infer.runner.draft_tokens import Proposal, draw_tokens
from tessera.infer.runner.paged_attention import PagedAttentionBatch, SequenceSlice
from tessera.infer.scheduling.block_manager import BlockManager
from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.models.rope import rope_cos_sin
from tessera.models.transformer import Transformer


@dataclass
class _MTPState:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions 0..num_computed-1 hold the module's keys/values from the target's states
    hidden_start: int = 0  # position of hidden[0]
    hidden: torch.Tensor | None = None  # [n, D] the target's last hidden states of positions hidden_start..
    block_hashes: list[bytes] = field(default_factory=list)  # unused: no prefix reuse in the module's cache
    drafts: bool = True  # False once positions are missing (a cached prefix, a gap): no drafts for it


def _trim(st: _MTPState) -> None:
    """Drop the target's states of positions the module has already run (it never reads them again)."""
    if st.hidden is not None and st.num_computed > st.hidden_start:
        st.hidden = st.hidden[st.num_computed - st.hidden_start:]
        st.hidden_start = st.num_computed


class OneLayerCache:
    """A draft's one layer sees the cache as its own layer (its layer id is past the model's): dense
    attention, or DeepSeek-V3.2's sparse attention, whose indexer keys the one-layer cache keeps beside
    the keys and values (`PagedKVCache.index_k`), so the layer's own indexer picks its top-k over every
    position the module has run, as its forward over the whole sequence does."""

    def __init__(self, batch: PagedAttentionBatch):
        self.batch = batch

    def attend(self, layer_id, q, k, v, scale, window, sinks=None):
        return self.batch.attend(0, q, k, v, scale, window, sinks)

    def attend_sparse(self, layer_id, q, k, v, scale, index_keys, choose):
        return self.batch.attend_sparse(0, q, k, v, scale, index_keys, choose)


@dataclass
class DraftRow:
    seq: Sequence
    state: _MTPState
    limit: int
    tokens: list[int]  # the module's input tokens this pass
    start: int  # position of tokens[0]
    hidden: torch.Tensor  # [len(tokens), D]


class HiddenStateProposer:
    """A one-layer draft fed with the target's hidden states (module docstring), over a paged cache
    of `num_blocks` blocks shaped by `layer_cfg` (one layer); `_run` is the subclass's."""

    def __init__(self, layer_cfg: ModelConfig, num_tokens: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.k, self.device = num_tokens, torch.device(device)
        self.kv = PagedKVCache(layer_cfg, num_blocks, block_size, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.state: dict[str, _MTPState] = {}
        # the target's block counts whose residual stream `observe` receives (PagedModel.keep_hidden)
        self.hidden_layers: tuple[int, ...] = ()

    # ---- what the target computed ----------------------------------------------------------
    def observe(self, request_id: str, start: int, hidden_TD: torch.Tensor) -> None:
        """The target's last hidden states of positions start.. of a request (this step's rows)."""
        st = self.state.setdefault(request_id, _MTPState())
        if not st.drafts:
            return
        if st.hidden is None:
            # a prompt past cached prefix blocks: the module would attend over positions it never ran
            st.drafts = start == 0
            st.hidden_start, st.hidden = start, hidden_TD if st.drafts else None
            return
        keep = start - st.hidden_start
        if keep < 0 or keep > st.hidden.shape[0]:
            st.drafts, st.hidden = False, None  # a gap in the positions: this request drafts no more
            return
        st.hidden = torch.cat([st.hidden[:keep], hidden_TD])
        _trim(st)

    def rollback(self, request_id: str, num_kept: int) -> None:
        """The target kept positions 0..num_kept-1: forget its states of the rejected drafts."""
        st = self.state.get(request_id)
        if st is not None and st.hidden is not None:
            st.hidden = st.hidden[:max(0, num_kept - st.hidden_start)]

    def release(self, request_id: str) -> None:
        st = self.state.pop(request_id, None)
        if st is not None:
            self.blocks.free_sequence(st)

    # ---- drafting ----------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Proposal]:
        proposals = [Proposal() for _ in seqs]
        rows = {i: r for i, (seq, lim) in enumerate(zip(seqs, limits)) if (r := self._catch_up_row(seq, lim))}
        if not rows:
            return proposals
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        for _ in range(max(r.limit for r in rows.values())):
            step = {i: r for i, r in rows.items() if len(proposals[i].tokens) < r.limit}
            if not step:
                break
            last_h, logits = self._run(list(step.values()))
            for (i, r), (tok, q), h in zip(step.items(), draw_tokens([r.seq for r in step.values()],
                                                                                  logits), last_h):
                proposals[i].tokens.append(tok)
                if q is not None:
                    probs[i].append(q)
                r.start, r.tokens, r.hidden = r.start + len(r.tokens), [tok], h[None]
        for i, qs in probs.items():
            if qs:
                proposals[i].probs = torch.stack(qs)
        for r in rows.values():
            r.state.num_computed = len(r.seq.token_ids) - 1  # the drafts' keys/values are not kept
            _trim(r.state)
        return proposals

    def _catch_up_row(self, seq: Sequence, limit: int) -> DraftRow | None:
        """The first pass of a sequence: positions num_computed..N-2 with the target's states and
        the real next tokens (None: no drafts for it this step)."""
        st = self.state.get(seq.request_id)
        N = len(seq.token_ids)
        if limit <= 0 or st is None or not st.drafts or st.hidden is None:
            return None
        a, b = st.num_computed, N - 1  # positions a..b-1
        if a >= b or a < st.hidden_start or b - st.hidden_start > st.hidden.shape[0]:
            return None
        if not self.blocks.ensure_slots(st, N + limit):
            return None
        hidden = st.hidden[a - st.hidden_start:b - st.hidden_start]
        return DraftRow(seq, st, limit, seq.token_ids[a + 1:b + 1], a, hidden)

    def _run(self, rows: list[DraftRow]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The draft layer over the rows packed: each row's output at its last position [D] and the
        logits there [R, V]."""
        raise NotImplementedError

    def _packed(self, rows: list[DraftRow]) -> tuple[PagedAttentionBatch, torch.Tensor, list[int]]:
        """The rows' attention batch over the draft's cache, their token ids [T] and each row's last index."""
        batch = PagedAttentionBatch(self.kv, [SequenceSlice(r.start, len(r.tokens), r.state.block_table)
                                              for r in rows], self.device)
        ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long, device=self.device)
        ends = (torch.tensor([len(r.tokens) for r in rows]).cumsum(0) - 1).tolist()
        return batch, ids, ends


class MTPProposer(HiddenStateProposer):
    """Drafts with `model.mtp["1"]` over a paged cache of `num_blocks` blocks."""

    def __init__(self, model: Transformer, num_tokens: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, source: str = "the model"):
        if model.mtp is None:
            raise ConfigError(f"speculative.method='mtp' needs a model with multi-token-prediction modules "
                              f"(model.mtp_depth > 0); {source} has none: use --speculative draft or prompt_lookup")
        super().__init__(replace(model.cfg, n_layers=1, mtp_depth=0), num_tokens, num_blocks, block_size, dtype,
                         device)
        self.model, self.module = model, model.mtp["1"]
        self.hidden_layers = (model.cfg.n_layers,)  # the last layer's output, before the final norm

    @torch.inference_mode()
    def _run(self, rows: list[DraftRow]) -> tuple[list[torch.Tensor], torch.Tensor]:
        batch, ids, ends = self._packed(rows)
        emb = self.model.tok_embeddings(ids)[None]
        h = torch.cat([r.hidden for r in rows]).to(emb.dtype)[None]
        cos, sin = rope_cos_sin(batch.positions[None], self.model.rope_inv_freq, self.model.rope_attention_factor,
                                emb.dtype)
        out, _ = self.module(h, emb, cos, sin, OneLayerCache(batch))
        last = out[0, ends]
        return list(last), self.model.lm_head(self.module.norm(last))
