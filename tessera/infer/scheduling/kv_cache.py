"""The paged KV cache: per layer, one tensor of slots for keys and one for values.

Slot s lives in block s // block_size at offset s % block_size; a sequence's keys are wherever its
block table points. Storage is [num_blocks * block_size, heads, dim] per layer, so writing the
new tokens of a step is one `index_copy_` and reading a sequence's context is one `index_select`
of its blocks.

With `int8=True` keys and values are stored as int8 with one fp32 scale per (slot, head):
x ~= q * s, s = max|x| / 127 over the head dim (symmetric absmax quantisation). Memory per
token and head is D + 4 bytes against 4 D for fp32 (2 D for bf16): (D + 4) / 4 D, 0.27 at D = 64,
about a quarter (a half of bf16). On CPU with the C++ kernel (infer/cpu/attention.py) every row of a
step, prompt chunks included, reads the int8 values and their scales in place, so every read sees the
rounding, whether or not its prefix came from the cache; elsewhere (`gather_blocks`, `gather_flat`)
attention reads dequantised values, and a prefill chunk that starts at position 0 attends to its own
keys before they are stored, so only later reads see the rounding (see paged_attention.py).

`release` gives the stores' memory back and `reclaim` allocates it again (the engine's sleep and
wake, between the rollout phases of a GRPO run that trains in the same process).
With `window_layers` (window_blocks.py) those layers' stores hold `window_blocks` blocks of their own
pool, addressed by a sequence's `window_table` (a ring of `window_ring` slots per sequence), and the
others `num_blocks`; a store's blocks are its rows / block_size.
A hybrid model's linear-attention layers (recurrent_state.py) store no keys or values: their stores
have no rows (`kv_layers` names the layers that do), and `bytes_per_block` counts only the others,
so the same memory budget holds n_layers / len(kv_layers) times the blocks.
DeepSeek-V3.2's sparse attention (tessera/models/attention_variants/sparse_mla.py) keeps its indexer's key of each token
beside the token's keys and values: `index_k`, one [slots, D_i] store per layer in the cache's dtype
(not quantised with int8), part of `stores()`, so a block carries them wherever it goes (tiers,
transfers, prefix reuse), and counted in `bytes_per_block`.
Shapes: T tokens, N sequences, L context length, G heads stored, D head dim.
"""

from __future__ import annotations

import torch

from tessera.config.model import ModelConfig


def kv_shapes(cfg: ModelConfig, tp_size: int = 1) -> tuple[int, int, int, int]:
    """(key heads, key dim, value heads, value dim) that the attention of `cfg` stores per token
    on one of `tp_size` tensor-parallel ranks (each holds 1/tp_size of the heads).
    MLA hands the seam per-head decompressed keys [nope + rope] and values [v_head_dim]."""
    if cfg.mla is not None:
        m = cfg.mla
        h = cfg.n_heads // tp_size
        return h, m.qk_nope_head_dim + m.qk_rope_head_dim, h, m.v_head_dim
    g = cfg.n_kv_heads // tp_size
    return g, cfg.head_dim, g, cfg.head_dim


def kv_layers(cfg: ModelConfig) -> list[int]:
    """The layers that store keys and values: every one that attends, not a hybrid model's recurrent
    layers, which keep a recurrent state instead (recurrent_state.py), nor a layer that is only an MLP
    (Nemotron-H's)."""
    return [i for i in range(cfg.n_layers) if cfg.has_attention(i)]


def index_key_dim(cfg: ModelConfig) -> int:
    """Width of the indexer key a sparse-attention layer stores per token (0: none)."""
    return cfg.mla.index_head_dim if cfg.mla is not None and cfg.mla.index_topk is not None else 0


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, int8: bool, tp_size: int = 1,
                    layers: int | None = None) -> int:
    """Bytes of one block in `layers` layers (None: every layer that stores keys and values)."""
    gk, dk, gv, dv = kv_shapes(cfg, tp_size)
    full = torch.empty((), dtype=dtype).element_size()
    elem = 1 if int8 else full
    per_token = (gk * dk + gv * dv) * elem + ((gk + gv) * 4 if int8 else 0) + index_key_dim(cfg) * full
    return per_token * block_size * (len(kv_layers(cfg)) if layers is None else layers)


def quantize_int8(x_TGD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) int8: values [T, G, D] int8 and scales [T, G] fp32."""
    x = x_TGD.float()
    scale = x.abs().amax(-1).clamp(min=1e-8) / 127.0
    q = torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", int8: bool = False, tp_size: int = 1,
                 window_layers: frozenset[int] = frozenset(), window_blocks: int = 0, window_ring: int = 0):
        self.num_blocks, self.block_size, self.dtype, self.int8 = num_blocks, block_size, dtype, int8
        self.window_layers, self.window_blocks = window_layers, window_blocks
        self.window_ring = window_ring  # slots of a sequence's ring in the windowed pool (window_blocks.py)
        gk, dk, gv, dv = kv_shapes(cfg, tp_size)
        self.kv_layers = kv_layers(cfg)
        # float64: attention over this cache computes in it, rounded back (EngineConfig.fp64_attention); None: `dtype`
        self.attention_dtype: torch.dtype | None = None
        rows = {i: (window_blocks if i in window_layers else num_blocks) * block_size for i in self.kv_layers}
        slots = [rows.get(i, 0) for i in range(cfg.n_layers)]  # a linear-attention layer: no rows
        store = torch.int8 if int8 else dtype
        self.k = [torch.zeros(n, gk, dk, dtype=store, device=device) for n in slots]
        self.v = [torch.zeros(n, gv, dv, dtype=store, device=device) for n in slots]
        di = index_key_dim(cfg)  # sparse attention's indexer keys (module docstring)
        self.index_k = [torch.zeros(n if di else 0, di, dtype=dtype, device=device) for n in slots]
        if int8:
            self.k_scale = [torch.ones(n, gk, device=device) for n in slots]
            self.v_scale = [torch.ones(n, gv, device=device) for n in slots]
        self._workspace: dict[str, torch.Tensor] = {}  # gather_flat's buffers (CPU)
        self._sizes: list[int] = []  # each store's bytes while released (`release`, `reclaim`)

    def write(self, layer: int, slots_T: torch.Tensor, k_TGD: torch.Tensor, v_TGD: torch.Tensor) -> None:
        if self.int8:
            qk, sk = quantize_int8(k_TGD)
            qv, sv = quantize_int8(v_TGD)
            self.k[layer].index_copy_(0, slots_T, qk)
            self.v[layer].index_copy_(0, slots_T, qv)
            self.k_scale[layer].index_copy_(0, slots_T, sk)
            self.v_scale[layer].index_copy_(0, slots_T, sv)
            return
        self.k[layer].index_copy_(0, slots_T, k_TGD.to(self.dtype))
        self.v[layer].index_copy_(0, slots_T, v_TGD.to(self.dtype))

    def write_index_keys(self, layer: int, slots_T: torch.Tensor, keys_TD: torch.Tensor) -> None:
        self.index_k[layer].index_copy_(0, slots_T, keys_TD.to(self.dtype))

    def gather_index_keys(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """The indexer keys of `blocks` back to back: [len(blocks) * block_size, D_i]."""
        store = self.index_k[layer]
        return self._per_block(store).index_select(0, blocks).view(-1, store.shape[1])

    def gather_blocks(self, layer: int, blocks_NM: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks: [N, M * block_size, G, D] each, in `dtype`; row n holds
        the slots of blocks_NM[n] in order. One `index_select` of contiguous blocks per tensor: a
        block is block_size * G * D values stored together, where a gather by slot would copy G * D
        values per index and need block_size times the indices."""
        N, M = blocks_NM.shape
        flat = blocks_NM.reshape(-1)

        def take(store: torch.Tensor) -> torch.Tensor:
            per_block = self._per_block(store)  # [blocks, block_size * G * D]
            return per_block.index_select(0, flat).view(N, M * self.block_size, *store.shape[1:])

        k, v = take(self.k[layer]), take(self.v[layer])
        if self.int8:
            k = k.to(dtype) * take(self.k_scale[layer])[..., None].to(dtype)
            v = v.to(dtype) * take(self.v_scale[layer])[..., None].to(dtype)
        return k.to(dtype), v.to(dtype)

    def gather_flat(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` back to back: [len(blocks) * block_size, G, D] each, in
        `dtype`. On CPU (full-precision cache) they are written into buffers the cache keeps and
        grows, so the result is valid until the next call: a layer reads them before the next
        layer gathers. Elsewhere, and for int8, fresh tensors."""
        n = blocks.numel()
        reuse = self.k[layer].device.type == "cpu" and not self.int8 and dtype == self.dtype

        def take(store: torch.Tensor, name: str) -> torch.Tensor:
            per_block = self._per_block(store)
            shape = (n * self.block_size, *store.shape[1:])
            if not reuse:
                return per_block.index_select(0, blocks).view(shape)
            buf = self._workspace.get(name)
            if buf is None or buf.numel() < per_block.shape[1] * n:
                buf = self._workspace[name] = torch.empty(per_block.shape[1] * max(n, 64), dtype=store.dtype)
            out = buf[:per_block.shape[1] * n].view(n, per_block.shape[1])
            torch.index_select(per_block, 0, blocks, out=out)
            return out.view(shape)

        k, v = take(self.k[layer], "k"), take(self.v[layer], "v")
        if self.int8:
            k = k.to(dtype) * take(self.k_scale[layer], "ks")[..., None].to(dtype)
            v = v.to(dtype) * take(self.v_scale[layer], "vs")[..., None].to(dtype)
        return k.to(dtype), v.to(dtype)

    def gather_slots(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slots `slots` [n]: [n, G, D] each, in `dtype` (int8 dequantised): what
        sparse attention reads of a context, its chosen tokens only (sparse_attention.py)."""
        k, v = self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
        if self.int8:
            k = k.to(dtype) * self.k_scale[layer].index_select(0, slots)[..., None].to(dtype)
            v = v.to(dtype) * self.v_scale[layer].index_select(0, slots)[..., None].to(dtype)
        return k.to(dtype), v.to(dtype)

    def _per_block(self, store: torch.Tensor) -> torch.Tensor:
        return store.view(store.shape[0] // self.block_size, -1)

    def layer_nbytes(self, layers) -> int:
        """Bytes the stores of `layers` hold now (keys, values and their int8 scales)."""
        return sum(t[i].untyped_storage().nbytes() for t in self._lists() for i in layers)

    def _lists(self) -> list[list[torch.Tensor]]:
        lists = [self.k, self.v, *([self.k_scale, self.v_scale] if self.int8 else [])]
        return lists + ([self.index_k] if any(t.numel() for t in self.index_k) else [])

    def stores(self) -> list[torch.Tensor]:
        """Every tensor of the cache (keys and values of each layer that stores them, then their int8
        scales, then sparse attention's indexer keys), each [num_blocks * block_size, ...]: a block's
        contents are row b of each, viewed per block."""
        return [t[i] for t in self._lists() for i in self.kv_layers]

    def read_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """The contents of `blocks`: one [len(blocks), block_size * ...] tensor per store, on the
        cache's device (copies)."""
        idx = torch.tensor(blocks, device=self.k[0].device)
        return [self._per_block(s).index_select(0, idx) for s in self.stores()]

    def write_blocks(self, blocks: list[int], contents: list[torch.Tensor]) -> None:
        """Put `contents` (as `read_blocks` gives them, on any device) into `blocks`."""
        idx = torch.tensor(blocks, device=self.k[0].device)
        for store, c in zip(self.stores(), contents, strict=True):
            self._per_block(store).index_copy_(0, idx, c.to(store.device, non_blocking=True))

    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero every slot of `blocks` in every layer (e.g. after inf/NaN was written there); -1 - b
        names block b of the windowed layers' pool (zeroed in those layers only, as b >= 0 in the others)."""
        if not blocks:
            return
        for window in (False, True):
            chosen = [-1 - b if window else b for b in blocks if (b < 0) == window]
            layers = [i for i in self.kv_layers if (i in self.window_layers) == window]
            if not chosen or not layers:
                continue
            b = torch.tensor(chosen, device=self.k[0].device)
            slots = (b[:, None] * self.block_size + torch.arange(self.block_size, device=b.device)).flatten()
            for i in layers:
                self.k[i].index_fill_(0, slots, 0)
                self.v[i].index_fill_(0, slots, 0)
                if self.index_k[i].numel():
                    self.index_k[i].index_fill_(0, slots, 0)
                if self.int8:  # a NaN scale times a zero value is still NaN
                    self.k_scale[i].index_fill_(0, slots, 1.0)
                    self.v_scale[i].index_fill_(0, slots, 1.0)

    @property
    def nbytes(self) -> int:
        """Bytes the cache's stores hold now (0 while released)."""
        return sum(t.untyped_storage().nbytes() for t in self.stores())

    @property
    def released(self) -> bool:
        return self.nbytes == 0

    def release(self) -> None:
        """Give the stores' memory back (each storage resized to 0 bytes, the tensors kept, so that
        whoever holds them holds them again after `reclaim`); the CPU gather buffers go too."""
        self._sizes = [t.untyped_storage().nbytes() for t in self.stores()]
        for t in self.stores():
            t.untyped_storage().resize_(0)
        self._workspace.clear()

    def reclaim(self) -> None:
        """Allocate the released stores again, as they were made: values 0, int8 scales 1."""
        for t, size in zip(self.stores(), self._sizes, strict=True):
            t.untyped_storage().resize_(size)
        for t in (*self.k, *self.v, *self.index_k):
            t.zero_()
        if self.int8:
            for t in (*self.k_scale, *self.v_scale):
                t.fill_(1.0)
