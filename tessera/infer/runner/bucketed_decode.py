"""The decode step at static shapes: a batch of one-token queries padded to a bucket, with inputs
in preallocated device tensors that are updated in place, so that the step can be captured once
per bucket in a CUDA graph and replayed (as vLLM, SGLang and rtp-llm do) instead of launching
hundreds of small kernels from Python every token.

A bucket is (batch size B, blocks per sequence MB): B is the smallest configured decode batch
size that holds the step's sequences (on CPU, where nothing is captured, exactly the step's
sequences: padding rows would only add work); MB, when the step replays a CUDA graph, is the
smallest power of two (capped at what the longest sequence may need) that covers the longest block
table, and when it runs eagerly the longest block table itself (spare blocks would only be read and
masked out). The inputs of a bucket are views of
buffers allocated once at the largest bucket: token ids, positions, the slot each new key/value
is written to, block tables and sequence lengths. Padding rows decode token 0 at position 0 into
a scratch block that no sequence owns; table entries past a sequence's own blocks point at the
scratch block and are masked out by the sequence's length.

Attention (`BlockTableAttention`, the model's `AttentionCache`) reads only the blocks of the
sequences' tables, MB of them per row: it gathers those blocks into [B, MB * block_size] keys and
values (`PagedKVCache.gather_blocks`) and runs SDPA with an additive mask over positions (inside
the sequence, inside the sliding window), built once per step.
The packed step of `paged_attention.py` is the reference it is tested against.
With a windowed pool (`PagedKVCache.window_layers`, scheduling/window_blocks.py) each row also has a
window table: the windowed layers write and read through a second set of slot and table buffers, whose
padding points at that pool's scratch block (its last one), as the first set's at the full pool's.

On CUDA a bucket is captured after a warm-up (three eager runs on a side stream) the first time
it is used, and replayed from then on; `enforce_eager` keeps every bucket eager. On CPU the same
step runs eagerly over exactly its rows, and its attention reads each row's own context only
(`RaggedDecodeAttention`, see ragged_attention.py: a padded gather copies and attends over the
longest context for every row, which on a CPU costs more than the projections).
Shapes: B rows, H query heads, G stored heads, D head dim, MB blocks per row,
L = MB * block_size context slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tessera.infer.runner.ragged_attention import RaggedContexts
from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.models.attention import ChunkedWindow, Window, masked_attention, window_allows
from tessera.models.model_input import ModelInput
from tessera.models.transformer import Transformer

log = logging.getLogger("tessera.infer")


def default_batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def block_buckets(max_blocks: int) -> list[int]:
    """1, 2, 4, ... below max_blocks, then max_blocks (the most one sequence can hold)."""
    return default_batch_buckets(max_blocks)


def graph_blocker(cfg, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> str | None:
    """Why the decode step of a model with config `cfg`, computing in `dtype` on `device`, cannot be
    captured in a CUDA graph (None: it can).

    MoE layers run their routed experts as one grouped GEMM (`torch._grouped_mm`) whose group
    offsets stay on the device only on its CUTLASS path: bf16, rows a multiple of 16 bytes, and a
    NVIDIA GPU of compute capability 9.x or 10.x (Hopper, Blackwell). Elsewhere the group sizes are
    read on the host (the experts' loop in models/moe/experts.py, or torch's own fallback), a
    synchronisation that a graph cannot hold."""
    moe = cfg.moe
    if moe is None:
        return None
    if not moe.grouped_gemm:
        return "MoE layers with moe.grouped_gemm=false loop over their experts with group sizes read on the host"
    if dtype != torch.bfloat16:
        return (f"MoE layers in {str(dtype).removeprefix('torch.')} size their expert groups on the host (only "
                "bf16 runs them as one grouped GEMM with the sizes on the device)")
    if cfg.dim % 8 or moe.ffn_dim % 8:
        return (f"MoE layers of dim={cfg.dim}, moe.ffn_dim={moe.ffn_dim} (not both multiples of 8) size their "
                "expert groups on the host")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        if torch.version.hip is not None:
            return "MoE layers size their expert groups on the host on ROCm (torch's grouped GEMM falls back there)"
        major, minor = torch.cuda.get_device_capability(device)
        if major not in (9, 10):
            return (f"MoE layers size their expert groups on the host on compute capability {major}.{minor} "
                    "(torch's grouped GEMM keeps them on the device on 9.x and 10.x only)")
    return None


@dataclass
class DecodeRow:
    token: int  # the newest token, the query of this step
    position: int  # its absolute position (= tokens already in the cache)
    block_table: list[int]  # covers position + 1 tokens (blocks past those are not read)
    adapter_slot: int = -1
    window_table: list[int] | None = None  # the windowed layers' blocks, where the cache has such a pool


class BlockTableAttention:
    """The `AttentionCache` of one bucket: writes the step's keys/values, then attends each row's
    query to the blocks of its own table (see the module docstring). Its tensors are views of the
    decoder's static buffers; `prepare` forgets the masks of the previous step, which `_mask`
    derives from them once per step (inside the captured region, so a replay recomputes them from
    the updated inputs)."""

    def __init__(self, kv: PagedKVCache, slots_B: torch.Tensor, tables_BM: torch.Tensor, lens_B: torch.Tensor,
                 windowed: BlockTableAttention | None = None):
        self.kv, self.slots_B, self.tables_BM, self.lens_B = kv, slots_B, tables_BM, lens_B
        self.windowed = windowed  # the windowed layers' (over the window tables), or None
        self.masks: dict[Window, torch.Tensor] = {}

    def prepare(self) -> None:
        self.masks = {}
        if self.windowed is not None:
            self.windowed.prepare()

    def _mask(self, window: Window, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, 1, L] additive, in the queries' dtype: 0 where key j is visible (j < length and, with
        a window, j inside the window of the query at length-1: `window_allows`), -inf elsewhere. Built
        once per step and window; SDPA would otherwise turn a boolean mask into this in every layer."""
        if window not in self.masks:
            k_pos = torch.arange(self.tables_BM.shape[1] * self.kv.block_size, device=self.lens_B.device)
            lens = self.lens_B[:, None]
            allowed = k_pos[None, :] < lens
            if window is not None:
                allowed &= window_allows(lens - 1, k_pos[None, :], window)
            bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
            self.masks[window] = bias[:, None, None, :]
        return self.masks[window]

    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: Window, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.windowed is not None and layer_id in self.kv.window_layers:
            return self.windowed.attend(layer_id, q_BHSD, k_BGSD, v_BGSD, scale, window, sinks)
        # the model sees the rows packed as one sequence: [1, H, B, D]
        self.kv.write(layer_id, self.slots_B, k_BGSD[0].transpose(0, 1), v_BGSD[0].transpose(0, 1))
        q_BH1D = q_BHSD.transpose(0, 2)
        k_BLGD, v_BLGD = self.kv.gather_blocks(layer_id, self.tables_BM, q_BHSD.dtype)
        gqa = q_BHSD.shape[1] != k_BLGD.shape[2]
        o_BH1D = masked_attention(q_BH1D, k_BLGD.transpose(1, 2), v_BLGD.transpose(1, 2),
                                  self._mask(window, q_BHSD.dtype), scale, gqa, sinks, self.kv.attention_dtype)
        return o_BH1D.transpose(0, 2)


class RaggedDecodeAttention:
    """The `AttentionCache` of an eager decode step on CPU: the step's keys/values are written to
    the same slots as the bucket's, then each row attends to exactly its own context
    (`ragged_attention.py`); padding rows read their one scratch slot."""

    def __init__(self, kv: PagedKVCache, slots_B: torch.Tensor, contexts: RaggedContexts,
                 windowed: RaggedDecodeAttention | None = None):
        self.kv, self.slots_B, self.contexts, self.windowed = kv, slots_B, contexts, windowed

    def ragged_plan(self, layer_id: int, window: Window) -> tuple[torch.Tensor, RaggedContexts] | None:
        """(the rows' cache slots, their contexts) where the C++ kernel reads layer `layer_id` in place
        as `attend` would (paged_attention.PagedAttentionBatch.ragged_plan), else None."""
        if (self.kv.attention_dtype is not None or isinstance(window, ChunkedWindow)
                or (self.windowed is not None and layer_id in self.kv.window_layers)):
            return None
        return self.slots_B, self.contexts

    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: Window, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.windowed is not None and layer_id in self.kv.window_layers:
            return self.windowed.attend(layer_id, q_BHSD, k_BGSD, v_BGSD, scale, window, sinks)
        self.kv.write(layer_id, self.slots_B, k_BGSD[0].transpose(0, 1), v_BGSD[0].transpose(0, 1))
        q_THD = q_BHSD[0].transpose(0, 1)
        out_THD = q_THD.new_empty(q_THD.shape[0], q_THD.shape[1], v_BGSD.shape[-1])
        self.contexts.attend(self.kv, layer_id, q_THD, out_THD, scale, window, sinks)
        return out_THD.transpose(0, 1)[None]


class _Bucket:
    def __init__(self, decoder: BucketedDecoder, B: int, MB: int):
        d = decoder
        self.B, self.MB = B, MB
        self.ids_1B, self.pos_1B = d.ids[:, :B], d.positions[:, :B]
        windowed = (BlockTableAttention(d.kv, d.w_slots[:B], d.w_tables[:B, :MB], d.lens[:B])
                    if d.w_slots is not None else None)
        self.cache = BlockTableAttention(d.kv, d.slots[:B], d.tables[:B, :MB], d.lens[:B], windowed)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_BV: torch.Tensor | None = None
        self.graph_failed = False

    def run(self, model: Transformer, ragged: tuple[RaggedContexts, RaggedContexts | None] | None = None
            ) -> torch.Tensor:
        self.cache.prepare()
        cache = self.cache
        if ragged is not None:
            c, w = self.cache, self.cache.windowed
            cache = RaggedDecodeAttention(c.kv, c.slots_B, ragged[0],
                                          RaggedDecodeAttention(c.kv, w.slots_B, ragged[1]) if w is not None else None)
        return model(ModelInput(tokens=self.ids_1B, positions=self.pos_1B, cache=cache)).logits[0]


class BucketedDecoder:
    """Runs decode steps at bucketed static shapes (eagerly, or as CUDA graph replays)."""

    def __init__(self, model: Transformer, kv: PagedKVCache, device: torch.device, batch_sizes: list[int],
                 max_blocks: int, scratch_block: int, lora=None, use_graphs: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.model, self.kv, self.device, self.lora = model, kv, torch.device(device), lora
        self.batch_sizes = sorted(set(batch_sizes))
        self.block_counts = block_buckets(max_blocks)
        self.scratch_block = scratch_block
        self.window_scratch = kv.window_blocks - 1  # the windowed pool's scratch block (its store's last)
        # what the caller asked for (False under enforce_eager), kept apart from what runs: on CPU,
        # or for a model a graph cannot hold, the step is eager whatever was asked
        self.graphs_requested = use_graphs
        self.use_graphs = use_graphs and self.device.type == "cuda"
        blocker = graph_blocker(model.cfg, dtype, self.device) if self.use_graphs else None
        if self.use_graphs and blocker is not None:
            log.info("the decode step runs eagerly: %s", blocker)
            self.use_graphs = False
        Bmax, MBmax = self.batch_sizes[-1], self.block_counts[-1]
        long = dict(dtype=torch.long, device=self.device)
        self.ids = torch.zeros(1, Bmax, **long)
        self.positions = torch.zeros(1, Bmax, **long)
        self.slots = torch.zeros(Bmax, **long)
        self.tables = torch.zeros(Bmax, MBmax, **long)
        windowed = bool(kv.window_layers)  # the windowed layers' slots and tables (None: no such pool)
        self.w_slots = torch.zeros(Bmax, **long) if windowed else None
        self.w_tables = torch.zeros(Bmax, MBmax, **long) if windowed else None
        self.lens = torch.ones(Bmax, **long)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.graph_pool = None
        self.replays = 0  # steps served by a captured graph
        self.eager_runs = 0  # steps run eagerly at a bucket's shape
        self.widest = 0  # the most rows one step has run (padding rows included)

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def bucket_for(self, num_rows: int, max_table: int) -> tuple[int, int]:
        B = next(b for b in self.batch_sizes if b >= num_rows)
        MB = next(m for m in self.block_counts if m >= max_table)
        return B, MB

    def _fill(self, rows: list[DecodeRow], B: int, MB: int) -> None:
        """Write the step's inputs into the static buffers (one host -> device copy of a packed array)."""
        n = len(rows)
        ids = [r.token for r in rows] + [0] * (B - n)
        pos = [r.position for r in rows] + [0] * (B - n)
        lens = [r.position + 1 for r in rows] + [1] * (B - n)
        slots, tables = self._addresses([r.block_table for r in rows], rows, B, MB, self.scratch_block)
        flat = torch.tensor([ids, pos, slots, lens], dtype=torch.long)
        flat_tables = torch.tensor(tables, dtype=torch.long)
        buffers = [(flat[0], self.ids[0, :B]), (flat[1], self.positions[0, :B]), (flat[2], self.slots[:B]),
                   (flat[3], self.lens[:B]), (flat_tables, self.tables[:B, :MB])]
        if self.w_slots is not None:
            w_slots, w_tables = self._addresses([r.window_table for r in rows], rows, B, MB, self.window_scratch)
            buffers += [(torch.tensor(w_slots, dtype=torch.long), self.w_slots[:B]),
                        (torch.tensor(w_tables, dtype=torch.long), self.w_tables[:B, :MB])]
        for host, buffer in buffers:
            buffer.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)

    def _addresses(self, tables_in: list[list[int]], rows: list[DecodeRow], B: int, MB: int,
                   scratch: int) -> tuple[list[int], list[list[int]]]:
        """The slot each row writes and the MB blocks each row reads, from `tables_in` (one per row);
        padding rows and entries past a row's blocks at `scratch`."""
        bs, n = self.kv.block_size, len(rows)
        slots = [t[r.position // bs] * bs + r.position % bs for t, r in zip(tables_in, rows)] + [scratch * bs] * (B - n)
        in_use = [t[:r.position // bs + 1] for t, r in zip(tables_in, rows)]  # blocks past these are never read
        return slots, [t + [scratch] * (MB - len(t)) for t in in_use] + [[scratch] * MB] * (B - n)

    def _ragged(self, rows: list[DecodeRow], B: int) -> tuple[RaggedContexts, RaggedContexts | None]:
        """Each row's own context (position + 1 keys), the padding rows' one scratch slot: over the
        block tables, and over the window tables where the cache has a windowed pool."""
        def contexts(tables: list[list[int]], scratch: int) -> RaggedContexts:
            out = RaggedContexts(self.kv.block_size)
            for i, (r, t) in enumerate(zip(rows, tables)):
                out.add(i, 1, r.position + 1, t)
            for i in range(len(rows), B):
                out.add(i, 1, 1, [scratch])
            out.freeze(self.device)
            return out

        windowed = contexts([r.window_table for r in rows], self.window_scratch) if self.w_slots is not None else None
        return contexts([r.block_table for r in rows], self.scratch_block), windowed

    @torch.inference_mode()
    def forward(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Logits [B, V] of the bucket; rows len(rows).. are padding (none on CPU)."""
        need = max(r.position // self.kv.block_size + 1 for r in rows)
        with_lora = any(r.adapter_slot >= 0 for r in rows)
        graphed = self.use_graphs and not with_lora
        B, MB = self.bucket_for(len(rows), need)
        if not graphed:  # block counts are bucketed for graph replays only: an eager step reads no spare blocks
            MB = need
            if self.device.type == "cpu":  # and on CPU, where no kernel launch is saved, no padding rows
                B = len(rows)
        bucket = self.buckets.get((B, MB))
        if bucket is None:
            bucket = _Bucket(self, B, MB)
            if graphed:  # an eager bucket is a few views: made again next time instead of kept
                self.buckets[(B, MB)] = bucket
        self.widest = max(self.widest, B)
        self._fill(rows, B, MB)
        if graphed and not bucket.graph_failed:
            if bucket.graph is None:
                self._capture(bucket)
            if bucket.graph is not None:
                bucket.graph.replay()
                self.replays += 1
                return bucket.logits_BV
        self.eager_runs += 1
        if self.lora is not None and with_lora:
            self.lora.set_batch([(r.adapter_slot, 1) for r in rows] + [(-1, 1)] * (B - len(rows)), self.device)
        try:
            return bucket.run(self.model, self._ragged(rows, B) if self.device.type == "cpu" else None)
        finally:
            if self.lora is not None and with_lora:
                self.lora.clear_batch()

    def _capture(self, bucket: _Bucket) -> None:
        """Warm the bucket up on a side stream, then capture it. The inputs are already filled, so
        the warm-up runs compute (and write to the cache) exactly what this step needs; a model
        that cannot be captured (a host sync inside, say) keeps this bucket eager."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                for _ in range(3):
                    bucket.run(self.model)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                bucket.logits_BV = bucket.run(self.model)
            bucket.graph = graph
        except Exception as e:  # the model cannot run inside a graph: this bucket stays eager
            log.warning("decode bucket (batch %d, %d blocks) runs eagerly: capture failed: %s",
                        bucket.B, bucket.MB, e)
            bucket.graph_failed, bucket.graph, bucket.logits_BV = True, None, None
            torch.cuda.synchronize(self.device)
