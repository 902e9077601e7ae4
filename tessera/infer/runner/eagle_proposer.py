"""Speculative decoding with an EAGLE-3 draft head (`--speculative eagle --draft-model DIR`; Li et al.
2025; tessera/models/eagle.py, the directory read by tessera/checkpoint/eagle_dir.py).

The executor keeps the target's residual stream after the draft's `feature_layers` block counts
from every packed forward (`PagedModel.keep_hidden`, the seam the MTP draft reads its last hidden
state through); each request's rows are fused by the draft's `fc` as they arrive (`observe`), so
the proposer keeps [D] per position, as the MTP proposer does. Drafting is `HiddenStateProposer`'s
(mtp_proposer.py): a catch-up pass over the positions the target computed since the last call,
with the fused features and the real next tokens, whose last row gives the first draft, then one
pass per further draft at the next position with the drafted token and the draft's own output in
place of the target's features (what EAGLE-3 trains for: training-time test). The draft layer has
a paged KV cache of its own; drafts' keys and values are overwritten by the next catch-up.

Tokens are embedded by the target's embedding (or the draft's own, where its directory has one);
a draft over a smaller vocabulary places its logits by `d2t`, the other tokens at -inf, so greedy
drafts and the draft distribution q of rejection sampling are over the target's vocabulary.
"""

from __future__ import annotations

import torch

from tessera.infer.runner.mtp_proposer import DraftRow, HiddenStateProposer, OneLayerCache
from tessera.models.eagle import EagleDraft
from tessera.models.transformer import Transformer


class EagleProposer(HiddenStateProposer):
    """Drafts with `draft` for `target` over a paged cache of `num_blocks` blocks."""

    def __init__(self, target: Transformer, draft: EagleDraft, num_tokens: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__(draft.cfg, num_tokens, num_blocks, block_size, dtype, device)
        self.target, self.draft = target, draft
        self.embedding = draft.embed if draft.embed is not None else target.tok_embeddings
        self.hidden_layers = draft.feature_layers  # what the executor keeps of each target forward

    @torch.inference_mode()
    def observe(self, request_id: str, start: int, hidden_TD: torch.Tensor) -> None:
        """The target's features of positions start.. of a request, fused to the draft's width."""
        super().observe(request_id, start, self.draft.fuse(hidden_TD))

    @torch.inference_mode()
    def _run(self, rows: list[DraftRow]) -> tuple[list[torch.Tensor], torch.Tensor]:
        batch, ids, ends = self._packed(rows)
        emb = self.embedding(ids)[None].to(self.draft.fc.weight.dtype)
        h = torch.cat([r.hidden for r in rows]).to(emb.dtype)[None]
        cos, sin = self.draft.rope(batch.positions[None], emb.dtype)
        out = self.draft(emb, h, cos, sin, OneLayerCache(batch))
        last = out[0, ends]
        return list(last), self.draft.logits(last)
