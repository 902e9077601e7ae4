"""Parameter counts of the modules in this folder, straight from a `ModelConfig`, without building
them (and without torch: the planner imports this).

They live beside the modules they count so that a change to a module's weights and to its count
is one change; the planner (layer 8) and the FLOP count behind the trainer's MFU (`flops.py`) use
them, and a test checks them against the real modules.
"""

from __future__ import annotations

from tessera.config.model import ModelConfig


def linear_attention_params(cfg: ModelConfig) -> int:
    """A Gated DeltaNet mixer (linear_attention/gated_deltanet.py): its projections in (q, k, v, z;
    b, a) and out, the depthwise convolution, A_log and dt_bias per value head, the gated norm; or a
    Kimi delta attention mixer's (kimi_delta_attention.py), dt_bias per channel."""
    la, h = cfg.linear_attention, cfg.dim
    if la.kind == "kda":  # Kimi delta attention: q, k, v, o; b; the low-rank forget gate and output gate
        hk, k = la.n_key_heads * la.key_head_dim, la.key_head_dim
        return 4 * h * hk + h * la.n_key_heads + 2 * (h * k + k * hk) + 3 * hk * la.conv_width + hk + \
            la.n_key_heads + k
    keys, values = la.n_key_heads * la.key_head_dim, la.n_value_heads * la.value_head_dim
    projections = h * (2 * keys + 2 * values) + h * 2 * la.n_value_heads + values * h
    return projections + (2 * keys + values) * la.conv_width + 2 * la.n_value_heads + la.value_head_dim


def indexer_params(cfg: ModelConfig) -> int:
    """Sparse attention's lightning indexer (models/attention_variants/sparse_mla.py): query and key projections, the
    keys' LayerNorm (gain and bias), the head weights; 0 without one."""
    m = cfg.mla
    if m is None or m.index_topk is None:
        return 0
    heads, d = m.index_n_heads, m.index_head_dim
    return m.q_lora_rank * heads * d + cfg.dim * d + 2 * d + cfg.dim * heads


def mamba_params(cfg: ModelConfig) -> int:
    """A Mamba-2 mixer (linear_attention/mamba2.py): in_proj to [z | x B C | dt], the depthwise convolution
    (and its bias), dt_bias, A_log and D per head, the gated norm, out_proj (and the projections' biases)."""
    m, h = cfg.mamba, cfg.dim
    inner = m.n_heads * m.head_dim
    channels = inner + 2 * m.n_groups * m.state_size
    n = h * (inner + channels + m.n_heads) + channels * m.conv_width + 3 * m.n_heads + inner + inner * h
    n += channels if m.conv_bias else 0
    return n + (inner + channels + m.n_heads + h if m.proj_bias else 0)


def attention_params(cfg: ModelConfig, layer: int | None = None) -> int:
    """Layer `layer`'s token mixer (None: a softmax-attention layer's)."""
    h = cfg.dim
    if layer is not None and cfg.is_linear_attention_layer(layer):
        return linear_attention_params(cfg)
    if layer is not None and cfg.is_mamba_layer(layer):
        return mamba_params(cfg)
    if cfg.mla is not None:
        m = cfg.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            q = h * cfg.n_heads * qk
        else:  # down-projection, its RMSNorm, up-projection
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * cfg.n_heads * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * cfg.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + cfg.n_heads * m.v_head_dim * h + indexer_params(cfg)
    hd = cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    n = h * (q + 2 * kv) + q * h + (h * q if cfg.attention_output_gate else 0)
    if cfg.qkv_bias:
        n += q * (2 if cfg.attention_output_gate else 1) + 2 * kv
    if cfg.out_bias:
        n += h
    if cfg.attention_sinks:  # one logit per head (gpt-oss)
        n += cfg.n_heads
    return n + qk_norm_params(cfg)


def qk_norm_params(cfg: ModelConfig) -> int:
    """The QK norms' gains: one head_dim each (per head, Qwen3), or every head's (OLMo 2)."""
    if not cfg.qk_norm:
        return 0
    return (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim if cfg.qk_norm_all_heads else 2 * cfg.head_dim


def mlp_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    h = cfg.dim
    if not cfg.is_moe_layer(layer):
        return (2 if cfg.activation == "relu2" else 3) * h * cfg.ffn_dim
    e = cfg.moe
    experts = e.top_k if active else e.num_experts
    mats = 2 if e.expert_activation == "relu2" else 3  # relu^2 experts (and shared expert): up and down only
    n = e.num_experts * h + experts * mats * h * e.ffn_dim + mats * h * e.shared_ffn_dim
    if e.shared_expert_gate:
        n += h
    if e.router_bias:
        n += e.num_experts
    if e.expert_activation == "clamped_swiglu":  # gpt-oss's experts: biases on both products
        n += experts * (2 * e.ffn_dim + h)
    return n


def embedding_params(cfg: ModelConfig) -> int:
    """Input embedding plus the LM head when untied."""
    return cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)


def block_norm_params(cfg: ModelConfig) -> int:
    """A block's RMSNorm gains: two (before or after attention and MLP), four with both."""
    return (4 if cfg.block_norms == "pre_post" else 2) * cfg.dim


def layer_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    if cfg.sublayers is not None:  # one sublayer and its norm (models/sublayer_block.py)
        mlp = cfg.sublayers[layer] in ("mlp", "moe")
        return (mlp_params(cfg, layer, active) if mlp else attention_params(cfg, layer)) + cfg.dim
    return attention_params(cfg, layer) + mlp_params(cfg, layer, active) + block_norm_params(cfg)


def mtp_params(cfg: ModelConfig, active: bool = False) -> int:
    """The multi-token-prediction modules (mtp.py): per depth k its block (layer n_layers + k - 1),
    the 2d -> d projection and three norms; the embedding and head are the model's."""
    d = cfg.dim
    return sum(layer_params(cfg, cfg.n_layers + k - 1, active) + 2 * d * d + 3 * d
               for k in range(1, cfg.mtp_depth + 1))


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Total parameters, the MTP modules included; active=True counts only the top-k routed
    experts of each MoE layer."""
    body = sum(layer_params(cfg, i, active) for i in range(cfg.n_layers))
    return body + embedding_params(cfg) + cfg.dim + mtp_params(cfg, active)


def _mixer_weight_groups(cfg: ModelConfig, layer: int) -> int:
    """`layer_weight_groups` of layer `layer`'s token mixer."""
    if cfg.is_mamba_layer(layer):  # in_proj, conv1d (its bias with it), dt_bias, A_log, D, the gated norm, out_proj
        return 7
    if cfg.is_linear_attention_layer(layer):
        la = cfg.linear_attention
        if la.kind == "kda":  # q, k, v; their convolutions (one depthwise product); f_a, f_b, g_a, g_b, b; dt_bias,
            return 13  # A_log; o_norm, o
        # the projections in (grouped: qkvz, ba; split: qkv, z, b, a), conv1d, dt_bias, A_log, the gated norm, out_proj
        return (4 if la.projections == "split" else 2) + 5
    if cfg.mla is not None:
        m = cfg.mla
        indexer = 4 if m.index_topk is not None else 0  # its query and key projections, key LayerNorm, head weights
        return (3 if m.q_lora_rank is not None else 1) + 4 + indexer
    return 4 + (2 if cfg.qk_norm else 0) + (1 if cfg.attention_sinks else 0)


def _mlp_weight_groups(cfg: ModelConfig, layer: int) -> int:
    """`layer_weight_groups` of layer `layer`'s MLP or MoE."""
    if not cfg.is_moe_layer(layer):
        return 2 if cfg.activation == "relu2" else 3
    e = cfg.moe
    mats = 2 if e.expert_activation == "relu2" else 3
    experts = 4 if e.expert_activation == "clamped_swiglu" else mats  # biases added by row: their own products
    shared = (mats if e.shared_ffn_dim else 0) + (1 if e.shared_expert_gate else 0)
    return 1 + (1 if e.router_bias else 0) + experts + shared  # the router; its bias (gpt-oss) added apart


def layer_weight_groups(cfg: ModelConfig, layer: int) -> int:
    """The parameter tensors of decoder layer `layer`, a linear layer's bias counted with its weight: the
    operations that take a weight, one autograd group each when torch's split pipeline backward takes the
    weights' gradients group by group (torch.distributed.pipelining's `stage_backward_weight`), and so the
    times its weight pass replays a recomputed block (tessera/plan/bubble.py's `block_replays`)."""
    norms = 1 if cfg.sublayers is not None else block_norm_params(cfg) // cfg.dim
    if cfg.sublayers is not None:
        mlp = cfg.sublayers[layer] in ("mlp", "moe")
        return norms + (_mlp_weight_groups(cfg, layer) if mlp else _mixer_weight_groups(cfg, layer))
    return norms + _mixer_weight_groups(cfg, layer) + _mlp_weight_groups(cfg, layer)
