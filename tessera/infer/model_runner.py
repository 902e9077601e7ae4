"""One forward pass of a model over a packed batch of ragged sequences on the paged KV cache.

Used for the target model by the engine and for the draft model by the speculative proposer.
The packing and the attention over the cache are described in `paged_attention.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    def __init__(self, model: Transformer, kv: PagedKVCache, device: torch.device | str, lora=None):
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.lora = lora  # tessera.infer.lora.LoRAManager or None

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
