"""What a hybrid model's recurrent mixer keeps for backward without recomputation: Gated DeltaNet and
Kimi delta attention (the chunked gated delta rule, tessera/models/linear_attention/delta_rule.py) and
Mamba-2 (chunked SSD, ssd.py), written from the storages autograd really keeps in their training forward
(listed with `torch.autograd.graph.saved_tensors_hooks` on the real layers; tests/plan/test_hybrid_plan.py
checks the sum against them, fp32, bf16 and under autocast). The forms compute in fp32 from fp32 copies of
their operands, so with bf16 parameters and activations their products are fp32's; only autocast runs them
in bf16.

Unlike an attention layer's, most of these are not a fixed size per token: the forms pad the sequence to
whole chunks, compute each slab of chunks' own terms at once (the slab sized by the constants in
tessera/models/flops.py), keep one state per chunk, and the last chunk's state update feeds only the final
state, which training drops (what only it saves is freed before backward). So each mixer's terms are totals
for one micro-batch of `batch` sequences of `seq` tokens, on a rank holding `heads` of the layer's heads
(SavedTensor.fixed, split "tp": `tp` times one rank's, so that the planner's division gives that rank's).
The token mixer's input `xn` is the layer's (activation_terms.py keeps it for each projection in
`linear_inputs`). Assumed, as at initialisation and in ordinary training: Kimi's per-channel decay and
Mamba-2's per-head decay stay within their forms' SPAN_LIMIT inside a chunk (their cheaper branch).
Shapes: B batch, S sequence, H heads, K key dim, V value dim, C chunk, W conv width, n chunks of a slab.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.models.flops import (
    DELTA_RULE_PER_CHANNEL_TERMS,
    DELTA_RULE_PER_HEAD_TERMS,
    DELTA_RULE_SUB_BLOCK,
    DELTA_RULE_TILE,
    SSD_SLAB_TERMS,
)
from tessera.plan.activation_dtypes import ActivationDtype
from tessera.plan.saved.saved_terms import SavedTensor


@dataclass
class _Totals:
    """Saved storages of one rank, as (name, elements, bytes per element) summed by name."""

    tp: int
    items: dict[tuple[str, int], float]

    def add(self, name: str, elements: float, itemsize: int) -> None:
        self.items[(name, itemsize)] = self.items.get((name, itemsize), 0.0) + elements

    def terms(self) -> list[SavedTensor]:
        return [SavedTensor(f"mixer.{name}", 0, size, "tp", fixed=n * self.tp)
                for (name, size), n in self.items.items() if n]


def _slabs(chunks: int, per_slab: int) -> list[tuple[int, int]]:
    """(first chunk, chunks) of each slab."""
    return [(first, min(per_slab, chunks - first)) for first in range(0, chunks, per_slab)]


def recurrent_linear_inputs(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The projections that read the layer's normalised input (each keeps it, or under autocast its own
    bf16 copy)."""
    if cfg.is_mamba_layer(layer):
        return ("in_proj",)
    if cfg.linear_attention.kind == "kda":
        return ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj")
    if cfg.linear_attention.projections == "split":
        return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    return ("in_proj_qkvz", "in_proj_ba")


def recurrent_chunks(cfg: ModelConfig, layer: int, seq: int) -> int:
    """Chunks the layer's chunked form cuts a sequence of `seq` tokens into (the delta rule's chunk of whole
    tiles, SSD's chunk)."""
    if cfg.is_mamba_layer(layer):
        return -(-seq // min(cfg.mamba.chunk_size, seq))
    C = min(cfg.linear_attention.chunk_size, seq)
    return -(-seq // (DELTA_RULE_TILE if C % DELTA_RULE_TILE == 0 else C))


def recurrent_mixer_terms(cfg: ModelConfig, layer: int, dt: ActivationDtype, tokens: int, batch: int,
                          tp: int = 1) -> list[SavedTensor]:
    """The mixer's own saved storages on one rank of `tp` (beside its input's, `recurrent_linear_inputs`)."""
    B, S = max(batch, 1), max(tokens // max(batch, 1), 1)
    if cfg.is_mamba_layer(layer):
        return _mamba(cfg, dt, B, S, tp)
    return _delta(cfg, dt, B, S, tp)


def _conv(t: _Totals, dt: ActivationDtype, B: int, S: int, channels: int, width: int, weight_copy: bool) -> None:
    """The short convolution: its padded input, its output (SiLU's input) and, where the weight it reads
    is not a parameter (a cast under autocast, Kimi's three taps concatenated), that weight."""
    c = dt.compute
    t.add("conv.input", B * channels * (S + width - 1), c)
    t.add("conv.out", B * channels * S, c)
    if weight_copy or dt.autocast:
        t.add("conv.weight", channels * width, c)


def _delta(cfg: ModelConfig, dt: ActivationDtype, B: int, S: int, tp: int) -> list[SavedTensor]:
    la = cfg.linear_attention
    kda = la.kind == "kda"
    H, K, V = la.n_value_heads // tp, la.key_head_dim, la.value_head_dim
    c, t = dt.compute, _Totals(tp, {})
    _conv(t, dt, B, S, (la.n_key_heads // tp) * 2 * K + H * V, la.conv_width, kda)
    t.add("beta", B * S * H, c)  # sigmoid keeps its output
    t.add("decay.rate", 2 * H, 4)  # exp(A_log) and its negation
    t.add("decay.softplus", 2 * B * S * H * (K if kda else 1), 4)  # softplus's input and output
    if kda:
        t.add("decay.low_rank", B * S * K, c)  # f_b_proj's input
        t.add("gate.low_rank", B * S * K, c)  # g_b_proj's input
    C = min(la.chunk_size, S)
    C = DELTA_RULE_TILE if C % DELTA_RULE_TILE == 0 else C
    N = -(-S // C)
    per_chunk = B * H * C * (DELTA_RULE_SUB_BLOCK * K if kda else K + V)
    per_slab = max(1, (DELTA_RULE_PER_CHANNEL_TERMS if kda else DELTA_RULE_PER_HEAD_TERMS) // per_chunk)
    shared = c == 4  # q and k enter the rule as views of their own fp32 storage (else each slab's fp32 copy)
    slabs = _slabs(N, per_slab)
    for first, n in slabs:
        _delta_slab(t, kda, B, S, H, K, V, C, N, first, n, shared)
    if shared and any((first + n) * C <= S for first, n in slabs):  # a slab reads q, k unpadded
        t.add("qk.source", B * S * (3 * H * K if kda else 2 * H * K), 4)  # Kimi: the conv's output; else q, k
    t.add("states", N * B * H * K * V, 4)  # each chunk's start state
    t.add("deltas", N * B * H * C * V, 4)  # each chunk's writes
    t.add("norm.input", B * (N * C if c == 4 else S) * H * V, 4)  # the rule's padded fp32 output, or a copy
    t.add("norm.rstd", B * S * H, 4)
    if not kda and c == 4 and la.projections == "grouped" and la.n_value_heads == la.n_key_heads:
        # one value head a key head: z is a view of in_proj_qkvz's output, which silu(z) keeps whole
        t.add("norm.gate_source", B * S * H * (2 * K + V), 4)
    if kda:  # x / rms, by the fp32 gain, sigmoid(gate)
        t.add("norm.fp32", 3 * B * S * H * V, 4)
    else:  # silu(z)'s input and silu(z); x / rms by the gain, which promotes it to the gain's dtype
        t.add("norm.fp32", 2 * B * S * H * V, 4)
        t.add("norm.gained", B * S * H * V, max(dt.weight, c))
        t.add("norm.weighted", B * S * H * V, c)  # the normalised value in the input's dtype, by the weight
    t.add("out_proj.input", B * S * H * V, c)
    return t.terms()


def _delta_slab(t: _Totals, kda: bool, B: int, S: int, H: int, K: int, V: int, C: int, N: int, first: int,
                n: int, shared: bool) -> None:
    """One slab of n chunks, from chunk `first` of N: q and k normalised (their L2 norms and factors; a
    copy where padded or not shared), the chunk terms (`_chunk_terms` / `_referred_chunk_terms`) and what
    the chunk steps read of them; the state updates of the last chunk feed only the dropped final state."""
    M = n * B * H * C  # rows of the slab's chunks
    rows = B * min(n * C, S - first * C)  # the slab's real tokens per head
    if n * C != rows // B or not shared:
        t.add("qk.slab_copy", 2 * M * K if n * C != rows // B else 2 * rows * H * K, 4)
    t.add("qk.l2", 6 * M, 4)  # per q and k: the norm, 1/norm and the factor in chunk order
    chunks = range(first, first + n)
    # K-sized terms the steps read: W and q exp(c) only once a chunk starts from a state with a gradient (not
    # the first), (k exp(c_C - c))^T only where a chunk's state update feeds a later chunk (not the last)
    unread = (0 if any(i >= 1 for i in chunks) else 2) + (0 if any(i <= N - 2 for i in chunks) else 1)
    if kda:
        t.add("chunk.k_sized", (10 - unread) * M * K, 4)
        t.add("chunk.v", M * V, 4)
        t.add("chunk.scores", 5 * M * C, 4)
        t.add("chunk.beta", M, 4)
        t.add("chunk.start", n * B * H * K, 4)
        if any(1 <= i <= N - 2 for i in chunks):
            t.add("chunk.decay", n * B * H * K, 4)
        return
    t.add("chunk.mask", C * C, 1)
    t.add("chunk.k_sized", (6 - unread) * M * K, 4)
    t.add("chunk.v", M * V, 4)
    t.add("chunk.scores", 8 * M * C, 4)
    # beta, exp(c) and exp(c_C - c) (exp keeps its output: the measuring hooks keep it alive even where only
    # the dropped final state reads it, a few bytes per token)
    t.add("chunk.decays", 3 * M, 4)


def _mamba(cfg: ModelConfig, dt: ActivationDtype, B: int, S: int, tp: int) -> list[SavedTensor]:
    m = cfg.mamba
    H, P, N, G = m.n_heads // tp, m.head_dim, m.state_size, m.n_groups // tp
    c, t = dt.compute, _Totals(tp, {})
    f = c if dt.autocast else 4  # the form's products: fp32 from fp32 operands, bf16 where autocast casts them
    channels = H * P + 2 * G * N
    _conv(t, dt, B, S, channels, m.conv_width, False)
    t.add("dt", 3 * B * S * H, 4)  # softplus's input, the clamp's and its output
    t.add("rate", 2 * H, 4)  # exp(A_log) and its negation
    t.add("x", B * S * (channels if c == 4 else H * P), 4)  # the conv's fp32 output x views, or x's copy
    L = min(m.chunk_size, S)
    chunks = -(-S // L)
    per_slab = max(1, SSD_SLAB_TERMS // (B * H * L * max(L, P * N // L)))
    for first, n in _slabs(chunks, per_slab):
        rows = n * L * B
        t.add("slab.decay", rows * H, 4)  # exp(c)
        t.add("slab.xdt", rows * H * P, 4)
        t.add("slab.mask", L * L, 1)
        live = sum(1 for i in range(first, first + n) if i <= chunks - 2)  # state updates that matter
        if f == 4:
            t.add("slab.bc", 2 * rows * G * N, 4)
            t.add("slab.scores", rows * G * L, 4)
            t.add("slab.x_scaled", rows * H * P, 4)
        else:  # the products run in bf16: their own casts, B's and x's twice when the writes matter
            t.add("slab.bc", (3 if live else 2) * rows * G * N, c)
            t.add("slab.scores", rows * G * L, c)
            t.add("slab.x_scaled", (2 if live else 1) * rows * H * P, c)
            t.add("slab.c_reads", (n - (1 if first == 0 else 0)) * B * G * L * N, c)
        t.add("slab.chunk_decay", n * B * H, 4)  # exp keeps its output (kept alive as in chunk.decays)
        t.add("slab.updates", live * B * H * P * N, 4)
        t.add("slab.states", n * B * H * P * N, f)
        t.add("slab.y", rows * H * P, f)
    if dt.weight != 4:  # D.float(), a copy of a 16-bit parameter, kept by the skip term's product
        t.add("skip.d_fp32", H, 4)
    t.add("norm.gate", B * S * (2 * H * P + 2 * G * N + H if c == 4 else H * P), 4)  # silu's fp32 input
    t.add("norm.fp32", 3 * B * S * H * P, 4)  # y in fp32, silu(z), their product
    t.add("norm.rstd", B * S * G, 4)
    t.add("norm.weighted", B * S * H * P, c)
    t.add("out_proj.input", B * S * H * P, c)
    return t.terms()
