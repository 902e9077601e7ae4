"""A model over its paged KV cache: the logits of a packed batch of ragged sequences.

`PagedModel` is one process's model, its KV cache and its static-shape decode step. The engine's
model runner drives it (or, under tensor parallelism, rank 0's copy of it together with the other
ranks' copies: `tp_executor.TensorParallelModel`); the draft model of speculative decoding has one
of its own. The packing and the attention over the cache are described in `paged_attention.py`.
With a `BucketedDecoder`, `forward_split` sends the single-token items (decodes) through the
static-shape decode step instead (`bucketed_decode.py`). A hybrid model's linear-attention layers
read and write their per-sequence states in `states`, a slot per item (`recurrent_step.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tessera.config.errors import ConfigError, require
from tessera.infer.config import EngineConfig
from tessera.infer.runner.bucketed_decode import BucketedDecoder, DecodeRow, default_batch_buckets
from tessera.infer.runner.multimodal import ImageEncoder, ImageSpan, PromptImage, mrope_rows
from tessera.infer.runner.paged_attention import PagedAttentionBatch, SequenceSlice
from tessera.infer.runner.recurrent_step import RecurrentStep, Segment, StatefulStep
from tessera.infer.scheduling.kv_cache import PagedKVCache, bytes_per_block, index_key_dim, kv_layers
from tessera.infer.scheduling.recurrent_state import (
    RecurrentStatePool,
    bytes_per_slot,
    is_hybrid,
    refuse_unsupported,
)
from tessera.infer.scheduling.state_snapshots import snapshot_count, snapshot_tokens
from tessera.infer.scheduling.window_blocks import WindowedLayers
from tessera.models.linear_attention.states import chunk_tokens
from tessera.models.model_input import ModelInput
from tessera.models.transformer import Transformer

log = logging.getLogger("tessera.infer")


@dataclass
class BatchItem:
    tokens: list[int]  # the tokens computed this step
    start: int  # absolute position of tokens[0]
    block_table: list[int]  # must cover start + len(tokens) positions
    adapter_slot: int = -1  # dynamic LoRA slot, -1 for the base model
    logits_from: int = 0  # the caller reads the logits of tokens[logits_from:] only (tensor parallelism gathers those)
    images: list[ImageSpan] = field(default_factory=list)  # image feature rows that replace placeholder tokens
    # Qwen2-VL: every image of the sequence's prompt, whose grids give its tokens' M-RoPE positions
    mrope_images: tuple[PromptImage, ...] = ()
    window_table: list[int] | None = None  # the windowed layers' blocks (scheduling/window_blocks.py)
    state_slot: int = -1  # a hybrid model's recurrent-state slot (recurrent_state.py), -1 for none
    drafts: int = 0  # speculative tokens at the end of `tokens`, verified after the forward
    state_from: int = -1  # the prefix-cache snapshot its slot starts from (state_snapshots.py), -1 for none
    snapshots: tuple[tuple[int, int], ...] = ()  # (offset in tokens, snapshot) to keep the state in


class PagedForward(Protocol):
    """The forward of one engine step over the paged KV cache: a `PagedModel`, or rank 0's
    `TensorParallelModel`, whose logits are every rank's forward gathered into full rows."""

    def forward_split(self, items: list[BatchItem]) -> tuple[torch.Tensor, list[int]]:
        """Logits [T, V] of the step (each item's rows from `logits_from` on are filled), and the row
        where each item's tokens start."""

    def forward(self, items: list[BatchItem]) -> torch.Tensor:
        """Logits [T, V] of every packed token, in the order of `items` (no static-shape decode step)."""

    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero KV blocks (after a request wrote inf/NaN there)."""


class PagedModel:
    """One rank's `PagedForward`: `model` over the KV cache `kv`, single-token items through
    `decoder` (the static-shape decode step; None: every item packed), LoRA adapters per item."""

    def __init__(self, model: Transformer, kv: PagedKVCache, device: torch.device | str, lora=None,
                 decoder: BucketedDecoder | None = None, encoder: ImageEncoder | None = None):
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.lora = lora  # tessera.infer.runner.lora.LoRAManager or None
        self.decoder = decoder
        # block counts whose residual stream the last packed forward keeps, concatenated over the
        # features, [T, len x D] (`hidden`; Transformer.forward's `keep_layers`): what a draft fed with
        # the target's hidden states reads, the MTP module the last layer's output (n_layers,), an
        # EAGLE head its low, middle and high layers' (mtp_proposer.py, eagle_proposer.py). (): none.
        self.keep_hidden: tuple[int, ...] = ()
        self.hidden: torch.Tensor | None = None
        # a vision-language model's image encoder (multimodal.py): items with images take its rows
        self.encoder = encoder
        # a hybrid model's recurrent-state slots (recurrent_state.py; its items carry `state_slot`)
        self.states: RecurrentStatePool | None = None
        self.recurrent: RecurrentStep | None = None  # the last packed step's, until its drafts are verified

    def forward_split(self, items: list[BatchItem]) -> tuple[torch.Tensor, list[int]]:
        """Logits of every computed token, and the row where each item's tokens start. Single-token
        items go through the static-shape decode step, up to its largest bucket; the rest are
        packed into one ragged batch (`forward`). Packed rows come first, then the decodes. When
        the decode step would not replay a CUDA graph and the step holds a longer item (a prompt
        chunk, drafts to verify), the decodes join it in the packed batch: one pass over the
        weights per step instead of two (the packed step attends a group of one-token queries over
        their blocks as the decode step does)."""
        decoder = self.decoder
        single = ([i for i, it in enumerate(items) if len(it.tokens) == 1 and not it.images and not it.mrope_images]
                  if decoder is not None else [])
        single = single[:decoder.max_batch] if single else []
        if single and not decoder.use_graphs and any(len(it.tokens) > 1 for it in items):
            single = []
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
            rows = [DecodeRow(items[i].tokens[0], items[i].start, items[i].block_table, items[i].adapter_slot,
                              items[i].window_table) for i in single]
            parts.append(decoder.forward(rows)[:len(single)])
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), offsets

    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero KV blocks (after a request wrote inf/NaN there)."""
        self.kv.clear_blocks(blocks)

    def keep_verified(self, kept: dict[int, int]) -> None:
        """After the last forward's drafts were verified: each recurrent-state slot keeps the state
        after its item's first `kept[slot]` tokens (recurrent_step.py)."""
        for slot, n in kept.items():
            self.recurrent.commit(slot, n)

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> torch.Tensor:
        """Logits [T, V] of every packed token, in the order of `items`."""
        slices = [SequenceSlice(it.start, len(it.tokens), it.block_table, it.window_table) for it in items]
        batch = PagedAttentionBatch(self.kv, slices, self.device)
        if self.states is not None:
            segments = [Segment(o, len(it.tokens), it.state_slot, it.start, it.drafts, it.state_from, it.snapshots)
                        for it, o in zip(items, packed_offsets(items), strict=True)]
            self.recurrent = RecurrentStep(self.states, segments, self.device)
            batch = StatefulStep(batch, self.recurrent)
        ids = torch.tensor([t for it in items for t in it.tokens], dtype=torch.long, device=self.device)
        if self.lora is not None:
            self.lora.set_batch([(it.adapter_slot, len(it.tokens)) for it in items], self.device)
        read = self._read_rows(items)
        try:
            sequence = ({"hidden": self._embedded(ids, items)[None]} if any(it.images for it in items)
                        else {"tokens": ids[None]})
            positions = self._mrope_positions(items, batch.positions) if any(it.mrope_images for it in items) \
                else batch.positions[None]
            out = self.model(ModelInput(**sequence, positions=positions, cache=batch, keep_layers=self.keep_hidden,
                                        logit_positions=read))
        finally:
            if self.lora is not None:
                self.lora.clear_batch()
        if self.keep_hidden:
            self.hidden = out.kept_hidden[0]
        logits = out.logits[0]
        if read is None or logits.shape[0] == ids.shape[0]:
            return logits
        # Rows nobody reads stay unwritten: on CPU their pages are never touched (allocated lazily).
        full_TV = logits.new_empty(ids.shape[0], logits.shape[-1])
        full_TV.index_copy_(0, read, logits)
        return full_TV

    def _read_rows(self, items: list[BatchItem]) -> torch.Tensor | None:
        """Rows of the packed step whose logits are read (each item's from `logits_from` on), or None
        for all of them. A LoRA adapter on the output head maps its rows over every token: all then."""
        if self.lora is not None and "output" in self.lora.weights:
            return None
        rows, t = [], 0
        for it in items:
            rows.extend(range(t + it.logits_from, t + len(it.tokens)))
            t += len(it.tokens)
        if len(rows) == t:
            return None
        return torch.tensor(rows, dtype=torch.long, device=self.device)


    def _mrope_positions(self, items: list[BatchItem], positions: torch.Tensor) -> torch.Tensor:
        """[3, 1, T] rotary positions of the packed step: M-RoPE ones for the items of sequences
        with Qwen2-VL images, each other token's position three times."""
        merge = self.encoder.model.cfg.vision.spatial_merge_size
        out = positions[None, None].expand(3, 1, -1).clone()
        for it, row in zip(items, packed_offsets(items), strict=True):
            if it.mrope_images:
                rows = mrope_rows(it.mrope_images, it.start, len(it.tokens), merge)
                out[:, 0, row:row + len(it.tokens)] = rows.to(out.device)
        return out

    def _embedded(self, ids: torch.Tensor, items: list[BatchItem]) -> torch.Tensor:
        """Token embeddings [T, D] of the packed step with the images' feature rows in place of their
        placeholders (the vision seam: `encode_images`, through the encoder's per-image cache)."""
        if self.encoder is None:
            raise ConfigError("this model takes no images")
        spans = [(row, span) for it, row in zip(items, packed_offsets(items)) for span in it.images]
        rows = self.encoder.features([span.image for _, span in spans])
        h = self.model.tok_embeddings(ids)
        for row, span in spans:
            h[row + span.row:row + span.row + span.count] = rows[span.image.key][span.first:span.first + span.count]
        return h


def packed_offsets(items: list[BatchItem]) -> list[int]:
    """The row where each item's tokens start when every item is packed in order."""
    offsets, t = [], 0
    for it in items:
        offsets.append(t)
        t += len(it.tokens)
    return offsets


@dataclass(frozen=True)
class CacheGeometry:
    max_model_len: int  # prompt + completion limit
    blocks_per_seq: int  # blocks one sequence of max_model_len (+ speculative lookahead) needs
    num_blocks: int  # blocks the block manager hands out (the cache holds one more: the scratch block)
    windowed: WindowedLayers | None = None  # layers whose blocks come from a pool of their own (None: no such pool)
    num_window_blocks: int = 0  # that pool's blocks (its stores hold one more: its scratch block)
    window_ring: int = 0  # slots of a sequence's ring in that pool (scheduling/window_blocks.py)
    num_snapshots: int = 0  # a hybrid model's recurrent-state snapshots for prefix caching (state_snapshots.py)
    snapshot_tokens: int = 0  # ... taken every this many tokens


def windowed_layers(cfg, config: EngineConfig, max_model_len: int) -> WindowedLayers | None:
    """The layers served from the windowed pool: those with a window shorter than max_model_len,
    under `windowed_kv="bounded"` (scheduling/window_blocks.py). KV tiers and disaggregation, which
    move blocks by their prefix, are refused with such a pool."""
    windowed = WindowedLayers.of(cfg, max_model_len) if config.windowed_kv == "bounded" else None
    require(windowed is None or (not config.has_kv_tiers and config.kv_role is None), "windowed_kv",
            config.windowed_kv, "'kept' with KV tiers or kv_role for a model with sliding-window or chunked "
            "layers (those move blocks by their prefix, whose slots a windowed pool reuses)")
    return windowed


def window_pool_blocks(windowed: WindowedLayers, config: EngineConfig) -> int:
    """Blocks of the windowed pool: a ring for each of max_num_seqs sequences (no sequence holds
    more, prompt chunks included: scheduling/window_blocks.py); with prefix caching, room for the
    kept blocks a sequence still sees after its ring turned away from them (one per sequence, and a
    step's prompt chunks after adopted prefixes), the rest of it the kept blocks' cache."""
    bs, seqs = config.block_size, config.max_num_seqs
    rings = seqs * windowed.blocks_per_seq(bs, config.lookahead)
    return rings + seqs + -(-config.max_num_batched_tokens // bs) if config.enable_prefix_caching else rings


def cache_geometry(cfg, config: EngineConfig) -> CacheGeometry:
    """The KV cache's size from the engine config. Under tensor parallelism each rank stores
    1/tensor_parallel_size of the heads, so the same memory budget holds that many times the blocks;
    every rank computes the same numbers. A block counts only the layers that store keys and values
    (a hybrid model's linear-attention layers store none: kv_cache.kv_layers). The windowed pool, if
    any, is paid from the budget first, and a hybrid model's recurrent-state slots before it; the
    settings those slots cannot serve are refused here, before any tensor-parallel process starts."""
    refuse_unsupported(cfg, config)
    max_model_len = config.max_model_len or cfg.max_seq_len
    if max_model_len > cfg.max_seq_len:
        raise ConfigError(f"max_model_len={max_model_len} is invalid: the model supports at most "
                          f"{cfg.max_seq_len} positions")
    bs, k = config.block_size, config.lookahead
    blocks_per_seq = -(-(max_model_len + k) // bs)
    windowed = windowed_layers(cfg, config, max_model_len)
    n_window = 0 if windowed is None else len(windowed.layers)
    num_window = 0 if windowed is None else window_pool_blocks(windowed, config)
    num_blocks = config.num_blocks
    num_snapshots, every = 0, 0
    if config.enable_prefix_caching and chunk_tokens(cfg):  # up to half of what the slots leave
        every = snapshot_tokens(bs, chunk_tokens(cfg), config.state_snapshot_tokens)
        per_slot = bytes_per_slot(cfg, config.torch_dtype, config.tensor_parallel_size)
        num_snapshots = snapshot_count(int(config.kv_cache_gib * 2**30) - config.max_num_seqs * per_slot, per_slot,
                                       config.max_num_seqs * -(-max_model_len // every))
    if num_blocks is None:  # from the memory budget (less the windowed pool and the recurrent-state slots),
        # but always room for one full sequence
        int8, tp = config.kv_cache_dtype == "int8", config.tensor_parallel_size
        per_block = bytes_per_block(cfg, bs, config.torch_dtype, int8, tp, len(kv_layers(cfg)) - n_window)
        budget = int(config.kv_cache_gib * 2**30) - num_window * bytes_per_block(cfg, bs, config.torch_dtype,
                                                                                  int8, tp, n_window)
        per_slot = bytes_per_slot(cfg, config.torch_dtype, tp)  # this rank's heads' states
        budget -= (config.max_num_seqs + num_snapshots) * per_slot
        num_blocks = config.max_num_seqs * blocks_per_seq + 1
        if per_block:
            num_blocks = min(max(budget, 0) // per_block, num_blocks)
        if num_blocks < blocks_per_seq:
            log.warning("kv_cache_gib=%s holds %d blocks; using %d (%.2f GiB) to fit one sequence of %d tokens",
                        config.kv_cache_gib, num_blocks, blocks_per_seq, blocks_per_seq * per_block / 2**30,
                        max_model_len)
            num_blocks = blocks_per_seq
    if num_blocks < blocks_per_seq:
        raise ConfigError(f"num_blocks={num_blocks} is invalid: one sequence of max_model_len="
                          f"{max_model_len} (+{k} speculative) needs {blocks_per_seq} blocks of "
                          f"{bs}; raise num_blocks / kv_cache_gib or lower max_model_len")
    ring = 0 if windowed is None else windowed.blocks_per_seq(bs, k) * bs
    return CacheGeometry(max_model_len, blocks_per_seq, num_blocks, windowed, min(num_window, num_blocks), ring,
                         num_snapshots, every)


def build_paged_model(model: Transformer, config: EngineConfig, lora=None,
                      device: torch.device | str | None = None,
                      encoder: ImageEncoder | None = None) -> tuple[PagedModel, CacheGeometry]:
    """`model` over a paged KV cache with its static-shape decode step, as `config` lays them out
    (the engine's, and each tensor-parallel rank's, the same way), with a vision-language model's
    image `encoder` when it has one. CUDA graphs are not captured under tensor parallelism (all
    ranks would have to replay in lockstep). A hybrid model gets its recurrent-state slots, one per
    sequence in flight, and every item packed (the static-shape decode step has no state slots)."""
    geometry = cache_geometry(model.cfg, config)
    device = torch.device(config.device if device is None else device)
    dtype, tp = config.torch_dtype, config.tensor_parallel_size
    # one block more than the block manager hands out: the scratch block of the decode step's padding rows
    windowed = geometry.windowed
    kv = PagedKVCache(model.cfg, geometry.num_blocks + 1, config.block_size, dtype, device,
                      config.kv_cache_dtype == "int8", tp, windowed.layers if windowed else frozenset(),
                      geometry.num_window_blocks + 1, geometry.window_ring)
    kv.attention_dtype = torch.float64 if config.fp64_attention else None
    sizes = config.decode_batch_sizes
    sizes = default_batch_buckets(config.max_num_seqs) if sizes is None else sizes
    states = None
    if is_hybrid(model.cfg):
        states = RecurrentStatePool(model.cfg, config.max_num_seqs, dtype, device, geometry.num_snapshots, tp)
        sizes = []
    if index_key_dim(model.cfg):  # sparse attention picks keys per sequence: no static-shape decode step
        sizes = []
    decoder = None if not sizes else BucketedDecoder(
        model, kv, device, sizes, geometry.blocks_per_seq, scratch_block=geometry.num_blocks, lora=lora,
        use_graphs=not config.enforce_eager and tp == 1, dtype=dtype)
    paged = PagedModel(model, kv, device, lora, decoder, encoder)
    paged.states = states
    return paged, geometry
