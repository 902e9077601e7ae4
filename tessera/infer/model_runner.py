"""One forward pass of a model over a packed batch of ragged sequences on the paged KV cache.

Used for the target model by the engine and for the draft model by the speculative proposer.
The packing and the attention over the cache are described in `paged_attention.py`. With a
`BucketedDecoder`, `forward_split` sends the single-token items (decodes) through the
static-shape decode step instead (`bucketed_decode.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.infer.bucketed_decode import BucketedDecoder, DecodeRow
from tessera.infer.kv_cache import PagedKVCache
from tessera.infer.paged_attention import PagedAttentionBatch, SequenceSlice
from tessera.models.transformer import Transformer


@dataclass
class BatchItem:
    tokens: list[int]  # the tokens computed this step
    start: int  # absolute position of tokens[0]
    block_table: list[int]  # must cover start + len(tokens) positions
    adapter_slot: int = -1  # dynamic LoRA slot, -1 for the base model


class ModelRunner:
    def __init__(self, model: Transformer, kv: PagedKVCache, device: torch.device | str, lora=None,
                 decoder: BucketedDecoder | None = None):
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.lora = lora  # tessera.infer.lora.LoRAManager or None
        self.decoder = decoder

    def forward_split(self, items: list[BatchItem]) -> tuple[torch.Tensor, list[int]]:
        """Logits of every computed token, and the row where each item's tokens start. Single-token
        items go through the static-shape decode step, up to its largest bucket; the rest are
        packed into one ragged batch (`forward`). Packed rows come first, then the decodes."""
        decoder = self.decoder
        single = [i for i, it in enumerate(items) if len(it.tokens) == 1] if decoder is not None else []
        single = single[:decoder.max_batch] if single else []
        chosen = set(single)
        packed = [i for i in range(len(items)) if i not in chosen]
        offsets, t = [0] * len(items), 0
        for i in packed + single:
            offsets[i] = t
            t += len(items[i].tokens)
        parts = []
        if packed:
            parts.append(self.forward([items[i] for i in packed]))
        if single:
            rows = [DecodeRow(items[i].tokens[0], items[i].start, items[i].block_table, items[i].adapter_slot)
                    for i in single]
            parts.append(decoder.forward(rows)[:len(single)])
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), offsets

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> torch.Tensor:
        """Logits [T, V] of every packed token, in the order of `items`."""
        slices = [SequenceSlice(it.start, len(it.tokens), it.block_table) for it in items]
        batch = PagedAttentionBatch(self.kv, slices, self.device)
        ids = torch.tensor([t for it in items for t in it.tokens], dtype=torch.long, device=self.device)
        if self.lora is not None:
            self.lora.set_batch([(it.adapter_slot, len(it.tokens)) for it in items], self.device)
        try:
            out = self.model(ids[None], positions=batch.positions[None], cache=batch)
        finally:
            if self.lora is not None:
                self.lora.clear_batch()
        return out.logits[0]
