"""Floating-point operations of a training step: the one count behind MFU and the planner.

Like `counting.py`, pure arithmetic on a `ModelConfig` beside the modules it counts (no torch), so
the trainer (layer 6) and the planner (layer 8) share it.

Convention (say it wherever an MFU is quoted):
- A multiply-add is 2 FLOPs. Only matrix products are counted: the weight GEMMs of every layer
  (attention projections, SwiGLU or the top-k routed experts plus shared experts, the router) and
  the LM head, plus the attention core (q k^T and the weighted sum of v). Norms, RoPE, softmax,
  activations and the embedding lookup are not counted (they are <1% for real sizes).
- Training is 3x the forward pass: forward, gradient of the input, gradient of the weights
  (Kaplan et al. 2020, arXiv 2001.08361: C ~= 6 N D). With `recompute` the hardware also
  re-runs forward work; `flops_per_token` counts *model* FLOPs (MFU) and `recompute_flops_per_token`
  the extra work (hardware FLOPs = the sum; HFU).
- Causal attention: a query attends on average to half of the keys. We count exactly half of the
  full s x s score matrix, s/2 keys per query (the convention of newer Megatron-LM and of
  FlashAttention's FLOP counters); `causal=False` counts all s keys, as Narayanan et al. 2021 and
  PaLM's 6N + 12 l h s do. With a sliding window w < s the band s w - w^2/2 of the matrix counts.

Per token, per layer, forward: 2 * (matmul weights of the layer) + 2 * n_heads * (d_qk + d_v) * keys.
Per token, LM head, forward: 2 * V * h.
A recurrent layer counts its projections as weights and, for its core, the chunked form the trainer
runs (prompts too), whatever the sequence length: its state does not grow. The gated delta rule (Gated
DeltaNet, Kimi delta attention; models/linear_attention/delta_rule.py) per head and token in chunks of C
(the chunk, cut to tiles of DELTA_RULE_TILE): its chunk's k k^T and q k^T, T's products with k and v
(6 C K + 4 C V: T's triangular solve is not a product) and the state's read, write and the writes'
correction (6 K V); SSD (Mamba-2, ssd.py) in chunks of L per token: C B^T per group, its product with
x and the state's write and read (2 L N G + 2 L H P + 4 N H P); both the short depthwise convolution's
2 W per channel, and their padding to whole chunks. For a dense GPT with ffn = 4h (or SwiGLU with
ffn = 8h/3), no GQA, causal=False and full recomputation, a step of B sequences costs
`96 B s l h^2 (1 + s/(6h) + V/(16 l h))` (Narayanan et al. 2021, arXiv 2104.04473, appendix);
without recomputation `72 B s l h^2 (1 + s/(6h) + V/(12 l h))`. Tests check both.
DeepSeek-V3.2's sparse attention attends to at most index_topk keys per query (counted as a window of
that width) and adds its lightning indexer: projections plus 2 H_i (D_i + 1) per key the query may see,
forward only (`indexer_forward_flops_per_token`).
"""

from __future__ import annotations

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.config.parallel import RECOMPUTE_CHOICES
from tessera.models.counting import attention_params, indexer_params, qk_norm_params

DELTA_RULE_TILE = 32  # the gated delta rule computes a chunk of whole tiles a tile at a time (delta_rule.py's TILE)
# fp32 elements of one slab of chunks the recurrent forms compute their own terms over at once (delta_rule.py:
# a decay per key channel, per head; ssd.py); here, torch-free, so the planner's saved tensors follow the slabs
DELTA_RULE_PER_CHANNEL_TERMS = 1 << 21
DELTA_RULE_PER_HEAD_TERMS = 1 << 19
DELTA_RULE_SUB_BLOCK = 8
SSD_SLAB_TERMS = 1 << 22


def attention_matmul_params(cfg: ModelConfig, layer: int | None = None) -> int:
    """Weights of layer `layer`'s token mixer that multiply every token (biases, norm gains and
    a DeltaNet's convolution and per-head gains excluded); None: a softmax-attention layer's."""
    if layer is not None and cfg.is_linear_attention_layer(layer):
        la = cfg.linear_attention
        keys, values = la.n_key_heads * la.key_head_dim, la.n_value_heads * la.value_head_dim
        if la.kind == "kda":  # q, k, v, o, b, and the two low-rank gates through K
            return cfg.dim * (4 * keys + la.n_key_heads + 2 * la.key_head_dim) + 2 * la.key_head_dim * keys
        return cfg.dim * (2 * keys + 2 * values + 2 * la.n_value_heads + values)
    if layer is not None and cfg.is_mamba_layer(layer):  # in_proj [z | x B C | dt] and out_proj
        m = cfg.mamba
        inner = m.n_heads * m.head_dim
        return cfg.dim * (2 * inner + 2 * m.n_groups * m.state_size + m.n_heads + inner)
    if layer is not None and cfg.sublayers is not None and cfg.sublayers[layer] in ("mlp", "moe"):
        return 0
    n = attention_params(cfg)
    if cfg.mla is not None:
        m = cfg.mla
        n -= m.kv_lora_rank + (m.q_lora_rank or 0)  # the latent RMSNorm gains
        return n - indexer_params(cfg)  # the indexer runs forward only: indexer_forward_flops_per_token
    hd = cfg.head_dim
    if cfg.qkv_bias:
        n -= (cfg.n_heads * (2 if cfg.attention_output_gate else 1) + 2 * cfg.n_kv_heads) * hd
    if cfg.out_bias:
        n -= cfg.dim
    if cfg.attention_sinks:
        n -= cfg.n_heads
    return n - qk_norm_params(cfg)


def mlp_matmul_params(cfg: ModelConfig, layer: int) -> int:
    """Weights one token multiplies in the MLP of `layer`: SwiGLU (relu^2's two matrices), or router +
    top-k experts + shared; none in a one-sublayer layer that is not an MLP (Nemotron-H)."""
    h = cfg.dim
    if cfg.sublayers is not None and cfg.sublayers[layer] not in ("mlp", "moe"):
        return 0
    if not cfg.is_moe_layer(layer):
        return (2 if cfg.activation == "relu2" else 3) * h * cfg.ffn_dim
    e = cfg.moe
    mats = 2 if e.expert_activation == "relu2" else 3
    n = e.num_experts * h + e.top_k * mats * h * e.ffn_dim + mats * h * e.shared_ffn_dim
    if e.shared_expert_gate:
        n += h
    return n


def attention_keys_per_query(seq_len: int, *, causal: bool = True, window: int | None = None) -> float:
    """Mean keys a query attends to under the half-matrix convention (see the module docstring)."""
    s = float(seq_len)
    if not causal:
        return s if window is None else float(min(seq_len, window))
    if window is None or window >= seq_len:
        return s / 2
    return window - window * window / (2 * s)  # band area s w - w^2/2, per query


def chunked_keys_per_query(seq_len: int, chunk: int, *, causal: bool = True) -> float:
    """Mean keys a query attends to when each sees only its own chunk of `chunk` positions (Llama 4):
    q whole chunks and a last one of r, each a triangle (causal, the half-matrix convention) or a square."""
    q, r = divmod(seq_len, chunk)
    area = q * chunk * chunk + r * r
    return area / (2.0 if causal else 1.0) / seq_len


def layer_keys_per_query(cfg: ModelConfig, layer: int, seq_len: int, *, causal: bool = True) -> float:
    """`attention_keys_per_query` of layer `layer`: its sliding window, or its chunks (model.attention_chunk_size
    on the layers with RoPE)."""
    if cfg.attention_chunk_size is not None and layer not in cfg.nope_layers:
        return chunked_keys_per_query(seq_len, cfg.attention_chunk_size, causal=causal)
    return attention_keys_per_query(seq_len, causal=causal, window=cfg.layer_window(layer))


def attention_core_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True,
                                   layer: int | None = None) -> float:
    """Forward FLOPs of q k^T and p v for one token in layer `layer`: 2 a (d_qk + d_v) keys; None:
    the mean over the layers (which differ where only some have a window, model.window_layers)."""
    if cfg.mla is not None:
        d_qk = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
        d_v = cfg.mla.v_head_dim
    else:
        d_qk = d_v = cfg.head_dim
    layers = range(cfg.n_layers) if layer is None else (layer,)
    total = sum(_core_flops(cfg, i, seq_len, causal, d_qk + d_v) for i in layers)
    return total / len(layers)


def _core_flops(cfg: ModelConfig, i: int, seq_len: int, causal: bool, d_qkv: int) -> float:
    """Layer i's core per token: attention's scores and sum, a recurrence's state work, nothing for an MLP."""
    if cfg.is_linear_attention_layer(i):
        return delta_rule_flops_per_token(cfg, seq_len)
    if cfg.is_mamba_layer(i):
        return ssd_flops_per_token(cfg, seq_len)
    if cfg.sublayers is not None and cfg.sublayers[i] in ("mlp", "moe"):
        return 0.0
    return 2.0 * cfg.n_heads * d_qkv * _core_keys_per_query(cfg, i, seq_len, causal)


def delta_rule_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of a Gated DeltaNet's or Kimi delta attention's core: the chunked delta rule
    and the convolution before it (module docstring)."""
    la = cfg.linear_attention
    kda = la.kind == "kda"  # Kimi delta attention: as many value heads as key heads, of the key dim
    heads, K = (la.n_key_heads if kda else la.n_value_heads), la.key_head_dim
    V = K if kda else la.value_head_dim
    C = min(la.chunk_size, seq_len)
    C = DELTA_RULE_TILE if C % DELTA_RULE_TILE == 0 else C
    padded = -(-seq_len // C) * C / seq_len
    channels = 2 * la.n_key_heads * K + heads * V
    return padded * heads * (6 * C * K + 4 * C * V + 6 * K * V) + 2.0 * channels * la.conv_width


def ssd_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of a Mamba-2 mixer's core: chunked SSD and the convolution before it
    (module docstring)."""
    m = cfg.mamba
    L = min(m.chunk_size, seq_len)
    padded = -(-seq_len // L) * L / seq_len
    H, P, N, G = m.n_heads, m.head_dim, m.state_size, m.n_groups
    channels = H * P + 2 * G * N
    return padded * (2 * L * N * G + 2 * L * H * P + 4 * N * H * P) + 2.0 * channels * m.conv_width


def _core_keys_per_query(cfg: ModelConfig, layer: int, seq_len: int, causal: bool) -> float:
    """Keys a query of layer `layer` attends to: sparse attention's index_topk at most, counted as a
    window of that many keys (each query's best, wherever they lie)."""
    if cfg.mla is not None and cfg.mla.index_topk is not None:
        return attention_keys_per_query(seq_len, causal=causal, window=cfg.mla.index_topk)
    return layer_keys_per_query(cfg, layer, seq_len, causal=causal)


def indexer_forward_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Forward FLOPs of sparse attention's lightning indexer for one token in one layer: its projections,
    and scoring every key the query may see (2 H_i D_i for the heads' products, 2 H_i for their weighted
    sum). It has no backward (the choice of keys is not differentiable): `flops_per_token` counts it once."""
    if cfg.mla is None or cfg.mla.index_topk is None:
        return 0.0
    m = cfg.mla
    weights = indexer_params(cfg) - 2 * m.index_head_dim  # less the LayerNorm's gain and bias
    return 2.0 * weights + 2.0 * m.index_n_heads * (m.index_head_dim + 1) * attention_keys_per_query(
        seq_len, causal=causal)


def layer_forward_flops_per_token(cfg: ModelConfig, layer: int, seq_len: int, *, causal: bool = True) -> float:
    """Forward FLOPs of one token through decoder layer `layer` (MoE layers count the top-k experts;
    sparse attention's indexer included)."""
    weights = attention_matmul_params(cfg, layer) + mlp_matmul_params(cfg, layer)
    indexer = 0.0 if cfg.is_linear_attention_layer(layer) else indexer_forward_flops_per_token(cfg, seq_len,
                                                                                               causal=causal)
    return 2.0 * weights + attention_core_flops_per_token(cfg, seq_len, causal=causal, layer=layer) + indexer


def head_forward_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs of the LM head for one token: 2 V h (the embedding lookup costs none)."""
    return 2.0 * cfg.vocab_size * cfg.dim


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Forward FLOPs of one token through the whole model."""
    body = sum(layer_forward_flops_per_token(cfg, i, seq_len, causal=causal) for i in range(cfg.n_layers))
    return body + head_forward_flops_per_token(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Model FLOPs of training on one token (forward + backward = 3 x forward), the MFU numerator.

    For MoE models this is the active count: 6 N_active-matmul + the attention term. Sparse
    attention's indexer runs forward only, so it counts once, not three times.
    """
    indexer = cfg.n_layers * indexer_forward_flops_per_token(cfg, seq_len, causal=causal)
    return 3.0 * forward_flops_per_token(cfg, seq_len, causal=causal) - 2.0 * indexer


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str, *, interval: int = 1,
                              causal: bool = True) -> float:
    """Extra forward work per token that activation recomputation adds (not in MFU), on every
    `interval`-th decoder layer: full, the layer's forward again; selective, the attention core
    again (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2); none: 0. The operator-level
    policy (op) re-runs what its save list does not keep, which the planner counts
    (tessera/plan/saved/recompute_terms.py); here it is refused.
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise ConfigError(f"recompute={recompute!r} is invalid: one of {', '.join(RECOMPUTE_CHOICES)}")
    if interval < 1:
        raise ConfigError(f"recompute interval={interval!r} is invalid: must be >= 1")
    if recompute == "op":
        raise ConfigError("recompute=op: what it re-runs depends on parallel.recompute_save; "
                          "tessera.plan.saved.recompute_terms counts it")
    if recompute == "none":
        return 0.0
    layers = range(0, cfg.n_layers, interval)
    if recompute == "selective":
        return len(layers) * attention_core_flops_per_token(cfg, seq_len, causal=causal)
    return sum(layer_forward_flops_per_token(cfg, i, seq_len, causal=causal) for i in layers)


def step_flops(cfg: ModelConfig, seq_len: int, tokens: float, *, causal: bool = True,
               recompute: str = "none", interval: int = 1) -> float:
    """FLOPs of one optimizer step over `tokens` tokens of sequences of length `seq_len`.

    recompute="none" gives model FLOPs (for MFU); another choice adds the recomputed forward work.
    """
    per_token = flops_per_token(cfg, seq_len, causal=causal)
    per_token += recompute_flops_per_token(cfg, seq_len, recompute, interval=interval, causal=causal)
    return per_token * tokens


def six_nd(n_params: float, tokens: float) -> float:
    """Training compute C = 6 N D (Kaplan et al. 2020): GPT-3 175B x 300B tokens = 3.15e23."""
    return 6.0 * n_params * tokens


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_len: int, peak_flops: float, *,
        causal: bool = True) -> float:
    """Model FLOPs utilisation: flops_per_token * tokens/s / peak FLOP/s (of the devices used)."""
    if peak_flops <= 0:
        raise ConfigError(f"peak_flops={peak_flops!r} is invalid: must be > 0")
    return flops_per_token(cfg, seq_len, causal=causal) * tokens_per_second / peak_flops
