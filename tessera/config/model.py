"""Model configuration: the shape of a dense or MoE decoder, one documented field at a time.

`ModelConfig` describes every family Tessera runs (LLaMA 2/3, Mistral, Qwen2/3, SmolLM3, OLMo 2/3,
Seed-OSS, EXAONE 4, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, Llama 4 text). `MoEConfig` holds the
router and expert settings, `MLAConfig` the multi-head latent attention shapes. Each family is a
module of `families/` (its HuggingFace mapping and its named configurations, which `presets.py` collects:
`get_preset("mixtral-8x7b")`); parameter and FLOP counts of a configuration are in
`tessera/models/counting.py` and `flops.py`, beside the modules they count.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tessera.config.errors import ConfigError, require
from tessera.config.families import REGISTRY
from tessera.config.limits import (
    MAX_DIM,
    MAX_EXPERTS,
    MAX_FFN_DIM,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_MTP_DEPTH,
    MAX_SEQ_LEN,
    MAX_SINKHORN_ITERS,
    MAX_VOCAB_SIZE,
)
from tessera.config.recurrent import LinearAttentionConfig, Mamba2Config

BLOCK_NORMS = ("pre", "post", "pre_post")  # ModelConfig.block_norms
FAMILIES = tuple(REGISTRY)  # tessera/config/families: one module each
MOE_FAMILIES = tuple(name for name, family in REGISTRY.items() if family.moe)
OPTIONAL_MOE_FAMILIES = tuple(name for name, family in REGISTRY.items() if family.moe_optional)
# The keys each kind of RoPE scaling needs (see tessera/models/rope.py).
ROPE_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("factor", "original_max_position_embeddings"),  # and short_factor, long_factor: lists
}
# ModelConfig.activation: SwiGLU, GeGLU with tanh-approximated GELU, or an ungated MLP of relu(x)^2 (Nemotron-H)
ACTIVATIONS = ("silu", "gelu_tanh", "relu2")
SUBLAYERS = ("mamba", "attention", "mlp", "moe")  # ModelConfig.sublayers' kinds


def _layer_list(layers: Any, n_layers: int) -> bool:
    """A list of distinct layer indices in 0..n_layers-1."""
    return isinstance(layers, list) and len(set(layers)) == len(layers) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in layers)


def _finite(value: Any) -> bool:
    """A real number (not a bool) that is neither inf nor NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class MoEConfig:
    """Router and experts of a Mixture-of-Experts layer.

    Every balancing method is a coefficient or a switch, so they combine freely: for example
    `aux_loss_coef=0.01, z_loss_coef=1e-3` is Switch + ST-MoE, `expert_bias=True` with
    `score_func="sigmoid"` is DeepSeek-V3.
    """

    num_experts: int = 8  # routed experts E
    top_k: int = 2  # experts per token k
    ffn_dim: int = 1024  # hidden size of one routed expert's SwiGLU
    # Layer placement. Layer i is MoE iff i >= first_k_dense, i not in dense_layers and
    # i % layer_freq == 0 (Megatron's moe_layer_freq convention; DeepSeek's first_k_dense_replace).
    layer_freq: int = 1
    first_k_dense: int = 0
    dense_layers: list[int] = field(default_factory=list)
    # Scores. softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3). With softmax, softmax_before_topk
    # picks softmax over all experts then top-k (Mixtral) vs top-k logits then softmax over k.
    score_func: str = "softmax"
    softmax_before_topk: bool = True
    norm_topk_prob: bool = True  # renormalise the k gate weights to sum to one
    scaling_factor: float = 1.0  # routed_scaling_factor of DeepSeek-V3: multiplies the gate weights
    n_groups: int = 1  # group-limited routing (DeepSeek-V3): experts split into n_groups groups
    topk_groups: int = 1  # ... of which the topk_groups best (sum of top-2 scores) stay eligible
    jitter_eps: float = 0.0  # multiplicative input noise U(1-eps, 1+eps), training only (Switch)
    # Balancing. Coefficients of 0 switch a loss off.
    # Per MoE layer, summed over layers (Megatron's convention; HF's router_aux_loss_coef is converted
    # on import/export, see tessera/config/families/moe.py).
    aux_loss_coef: float = 0.0  # Switch/GShard  alpha * E * sum_i f_i P_i  (alpha ~ 1e-2)
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V2 sequence-level variant (alpha ~ 1e-4)
    z_loss_coef: float = 0.0  # ST-MoE router z-loss  beta * mean(logsumexp^2)  (beta ~ 1e-3)
    sinkhorn: bool = False  # S-BASE: choose experts from a Sinkhorn-balanced assignment in training
    sinkhorn_iters: int = 30
    expert_bias: bool = False  # DeepSeek-V3 aux-loss-free bias, added to scores for selection only
    bias_update_rate: float = 1e-3  # bias += rate * sign(mean_count - count_i) after each step
    # Capacity. None means dropless. Otherwise capacity = ceil(T k / E * capacity_factor).
    capacity_factor: float | None = None
    drop_policy: str = "probs"  # "probs": keep highest gate weight; "position": keep earliest
    pad_to_capacity: bool = False  # every expert computes exactly `capacity` rows
    # Shared experts, always applied (DeepSeek, Qwen2-MoE).
    shared_ffn_dim: int = 0  # hidden size of the shared SwiGLU (0 = none)
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(x @ w)
    gate_input: bool = False  # Llama 4: the gate weight scales the token going into its expert (top-1), not the output
    grouped_gemm: bool = True  # torch._grouped_mm where it applies, else a per-expert loop
    # gpt-oss: a bias on the router's logits, and experts with biases whose activation is the clamped
    # SwiGLU (up + 1) * g * sigmoid(alpha g), g = min(gate, limit), up clamped to +-limit (models/moe/biased_experts.py)
    router_bias: bool = False
    # "swiglu", "clamped_swiglu" (experts with biases, gpt-oss's layout) or "relu2" (ungated relu(x)^2 experts and
    # shared experts: Nemotron-H's MoE layers)
    expert_activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense and i not in self.dense_layers and i % self.layer_freq == 0


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 section 2.1): low-rank joint KV compression
    with a decoupled RoPE part shared by all heads."""

    q_lora_rank: int | None = 1536  # None: queries use one full projection
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True  # DeepSeek's checkpoints keep rotary pairs interleaved
    # DeepSeek-V3.2's sparse attention (tessera/models/attention_variants/sparse_mla.py): a lightning
    # indexer of index_n_heads heads of index_head_dim scores the keys, each query attends to its
    # index_topk best; None: dense MLA
    index_topk: int | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128


@dataclass
class ModelConfig:
    """Shape of a decoder-only language model. Defaults are a LLaMA-style 7B-ish block."""

    family: str = "llama"  # one of FAMILIES: decides the HuggingFace layout on export
    vocab_size: int = 32000
    dim: int = 4096  # hidden size h
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (multi-head); fewer = grouped-query attention
    head_dim: int | None = None  # None = dim // n_heads (Qwen3 sets it explicitly)
    ffn_dim: int = 11008  # SwiGLU hidden size of dense layers
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192} or a "yarn" dict.
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q, k, v
    out_bias: bool = False  # LLaMA's attention_bias also puts one on the output projection
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: attend to the last `sliding_window` keys only
    # Layers whose attention has no positional encoding (SmolLM3's NoPE layers: every 4th); the rest rotate by RoPE.
    nope_layers: list[int] = field(default_factory=list)
    # With sliding_window: the layers it applies to (OLMo 3: three of every four); None: every layer (Mistral).
    window_layers: list[int] | None = None
    # The RoPE base of the window_layers, unscaled (OLMo 3 with YaRN on its full layers, Gemma 3's local
    # base); None: they rotate as the other layers do (rope_theta, rope_scaling).
    local_rope_theta: float | None = None
    # Llama 4's chunked local attention: each layer with RoPE (not in nope_layers) lets position i see only
    # the positions of its own chunk of this many, i - i % size .. i; None: no chunks.
    attention_chunk_size: int | None = None
    # Llama 4's use_qk_norm: q and k of the layers with RoPE divided by their RMS over each head, no weight.
    qk_l2_norm: bool = False
    rope_interleave: bool = False  # Llama 4: RoPE rotates adjacent pairs (x0, x1), (x2, x3) ..., not the two halves
    # Llama 4's attention temperature tuning: the queries of the layers without RoPE (nope_layers) at
    # position p times 1 + nope_attn_scale * log(1 + floor((p + 1) / nope_floor_scale)); 0: off.
    nope_attn_scale: float = 0.0
    nope_floor_scale: int = 8192
    # Where each block's RMSNorms sit: "pre" before attention and MLP (LLaMA); "post" on their outputs,
    # before the residual add (OLMo 2); "pre_post" both (Gemma 3).
    block_norms: str = "pre"
    qk_norm_all_heads: bool = False  # with qk_norm: one RMSNorm over all heads' q, one over all of k (OLMo 2)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each query's softmax denominator
    # The MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with tanh GELU: Gemma 3).
    activation: str = "silu"
    norm_unit_offset: bool = False  # every RMSNorm scales by (1 + weight), weight starting at 0 (Gemma 3, Qwen3-Next)
    embed_scale: bool = False  # embeddings multiplied by sqrt(dim), rounded to the model's dtype (Gemma 3)
    # The softmax scale is query_pre_attn_scalar^-0.5 (Gemma 3); None: head_dim^-0.5.
    query_pre_attn_scalar: float | None = None
    # The share of each head's dimensions RoPE rotates (the first ones; GLM-4.5's 0.5, Phi-4-mini's 0.75,
    # Qwen3-Next's 0.25); the rest pass unrotated.
    partial_rotary_factor: float = 1.0
    mla: MLAConfig | None = None  # set for multi-head latent attention (DeepSeek-V2/V3)
    moe: MoEConfig | None = None  # set for MoE models
    init_std: float = 0.02  # normal init std of every weight matrix
    # Multi-token prediction (DeepSeek-V3 section 2.2; tessera/models/mtp.py): mtp_depth modules
    # after the last layer, module k predicting token i+k+1; 0 = off. The training objective adds
    # mtp_loss_weight / mtp_depth * sum_k (depth k's token-loss sum) / N (lambda in the report).
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    linear_attention: LinearAttentionConfig | None = None  # hybrid: Gated DeltaNet on its layers (Qwen3-Next)
    attention_output_gate: bool = False  # Qwen3-Next: wq also projects a gate, output *= sigmoid(gate)
    mamba: Mamba2Config | None = None  # hybrid: Mamba-2 on the layers `sublayers` marks "mamba" (Nemotron-H)
    # Nemotron-H: each layer is one sublayer after its one RMSNorm, added to the residual stream: "mamba"
    # (model.mamba), "attention" or "mlp" (tessera/models/sublayer_block.py); None: every layer is a token
    # mixer then an MLP
    sublayers: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        if isinstance(self.linear_attention, dict):
            self.linear_attention = LinearAttentionConfig(**self.linear_attention)
        if isinstance(self.mamba, dict):
            self.mamba = Mamba2Config(**self.mamba)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        self.validate()

    # ---- derived -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(i)

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head RoPE rotates (MLA: its decoupled RoPE part)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i's attention (None: it sees every earlier position)."""
        return self.sliding_window if self.window_layers is None or i in self.window_layers else None

    def is_linear_attention_layer(self, i: int) -> bool:
        return self.linear_attention is not None and i in self.linear_attention.layers

    def is_mamba_layer(self, i: int) -> bool:
        return self.sublayers is not None and self.sublayers[i] == "mamba"

    def has_attention(self, i: int) -> bool:
        """Whether layer i attends (softmax or latent attention, with a key/value cache)."""
        return not self.is_linear_attention_layer(i) and (self.sublayers is None or self.sublayers[i] == "attention")

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Refuse (ConfigError naming `model.KEY`, the value and what is allowed) a shape Tessera
        cannot build: the family and sizes, then RoPE scaling, MLA and MoE, each in its own step."""
        self._check_family()
        self._check_sizes()
        self._check_gemma_parts()
        self._check_rope_scaling()
        if self.mla is not None:
            self._check_mla(self.mla)
        if self.moe is not None:
            self._check_moe_router(self.moe)
            self._check_moe_experts(self.moe)
        if self.linear_attention is not None:
            self._check_linear_attention(self.linear_attention)
        if self.mamba is not None:
            self._check_mamba(self.mamba)
        self._check_sublayers()

    def _check_family(self) -> None:
        require(self.family in FAMILIES, "model.family", self.family, f"one of {', '.join(FAMILIES)}")
        require(self.family in OPTIONAL_MOE_FAMILIES or (self.moe is not None) == (self.family in MOE_FAMILIES),
                "model.family", self.family,
                f"MoE families ({', '.join(MOE_FAMILIES)}) need a model.moe section and the others must not have one"
                f" (model.moe is {'set' if self.moe is not None else 'unset'})")

    def _check_sizes(self) -> None:
        """The decoder's sizes, multi-token prediction and the numbers of its layers."""
        for key, top in (("vocab_size", MAX_VOCAB_SIZE), ("dim", MAX_DIM), ("n_layers", MAX_LAYERS),
                         ("n_heads", MAX_HEADS), ("ffn_dim", MAX_FFN_DIM), ("max_seq_len", MAX_SEQ_LEN)):
            require(0 < getattr(self, key) <= top, f"model.{key}", getattr(self, key),
                    f"must be an integer in 1..{top:,}")
        require(0 < self.n_kv_heads <= MAX_HEADS and self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads",
                self.n_kv_heads, f"must be positive and divide n_heads={self.n_heads}")
        require(0 < self.head_dim <= MAX_HEAD_DIM and (self.mla is not None or self.head_dim % 2 == 0),
                "model.head_dim", self.head_dim,
                f"must be a positive even number (RoPE rotates pairs), at most {MAX_HEAD_DIM:,}")
        require(0 <= self.mtp_depth <= MAX_MTP_DEPTH, "model.mtp_depth", self.mtp_depth,
                f"must be an integer in 0..{MAX_MTP_DEPTH} (0 = no multi-token prediction)")
        require(not (self.mtp_depth and self.sublayers is not None), "model.mtp_depth", self.mtp_depth,
                "0 for a model of single sublayers (model.sublayers, Nemotron-H): a prediction depth's block is "
                "a whole decoder layer")
        require(_finite(self.mtp_loss_weight) and self.mtp_loss_weight >= 0, "model.mtp_loss_weight",
                self.mtp_loss_weight, "must be a finite number >= 0")
        for key in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, key)
            require(_finite(value) and value > 0, f"model.{key}", value, "must be a finite number > 0")
        require(self.sliding_window is None or 0 < self.sliding_window <= MAX_SEQ_LEN, "model.sliding_window",
                self.sliding_window, f"must be None or an integer in 1..{MAX_SEQ_LEN:,}")
        require(_layer_list(self.nope_layers, self.n_layers), "model.nope_layers", self.nope_layers,
                f"must be a list of distinct layer indices in 0..{self.n_layers - 1}")
        require(self.window_layers is None or (self.sliding_window is not None and _layer_list(
            self.window_layers, self.n_layers)), "model.window_layers", self.window_layers,
            f"must be None (the window on every layer) or, with a sliding_window, distinct layer indices in "
            f"0..{self.n_layers - 1}")
        require(self.local_rope_theta is None or (self.window_layers is not None and _finite(self.local_rope_theta)
                                                  and self.local_rope_theta > 0), "model.local_rope_theta",
                self.local_rope_theta, "must be None or, with model.window_layers, a finite number > 0")
        require(_finite(self.nope_attn_scale) and self.nope_attn_scale >= 0, "model.nope_attn_scale",
                self.nope_attn_scale, "must be a finite number >= 0 (0 = no temperature tuning)")
        require(0 < self.nope_floor_scale <= MAX_SEQ_LEN, "model.nope_floor_scale", self.nope_floor_scale,
                f"must be an integer in 1..{MAX_SEQ_LEN:,}")
        chunk = self.attention_chunk_size
        require(chunk is None or (0 < chunk <= MAX_SEQ_LEN and self.sliding_window is None),
                "model.attention_chunk_size", chunk,
                f"must be None or an integer in 1..{MAX_SEQ_LEN:,}, without a sliding_window")
        require(self.block_norms in BLOCK_NORMS, "model.block_norms", self.block_norms,
                f"one of {', '.join(BLOCK_NORMS)}")
        require(not self.qk_norm_all_heads or (self.qk_norm and self.mla is None), "model.qk_norm_all_heads",
                self.qk_norm_all_heads, "needs model.qk_norm=true and no MLA")
        require(not self.attention_sinks or self.mla is None, "model.attention_sinks", self.attention_sinks,
                "needs grouped-query attention (no model.mla: latent attention has no sinks)")

    def _check_gemma_parts(self) -> None:
        """The MLP's activation, the softmax scale and the rotated share of each head."""
        relu2 = self.moe is not None and self.moe.expert_activation == "relu2"
        require(self.activation in ACTIVATIONS and (self.activation == "silu" or self.moe is None or relu2),
                "model.activation", self.activation, f"one of {', '.join(ACTIVATIONS)} (routed experts are SwiGLU: "
                "silu with model.moe, unless model.moe.expert_activation=relu2)")
        require(self.query_pre_attn_scalar is None or (_finite(self.query_pre_attn_scalar)
                                                       and self.query_pre_attn_scalar > 0),
                "model.query_pre_attn_scalar", self.query_pre_attn_scalar, "must be None or a finite number > 0")
        f = self.partial_rotary_factor
        require((self.mla is not None and f == 1) or (self.mla is None and _finite(f) and 0 < f <= 1 and int(
            self.head_dim * f) % 2 == 0 and int(self.head_dim * f) > 0), "model.partial_rotary_factor", f,
                f"must be in (0, 1] rotating an even number of the head_dim={self.head_dim} dimensions (1 with MLA)")

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        require(kind in ROPE_SCALING_KEYS, "model.rope_scaling.rope_type", kind,
                f"one of {', '.join(ROPE_SCALING_KEYS)}")
        for key in ROPE_SCALING_KEYS[kind]:
            value = self.rope_scaling.get(key)
            require(_finite(value) and value > 0, f"model.rope_scaling.{key}", value,
                    f"rope_type {kind} needs a finite number > 0")
        if kind == "longrope":
            for key in ("short_factor", "long_factor"):
                value = self.rope_scaling.get(key)
                require(isinstance(value, list) and len(value) == self.rope_dim // 2 and all(
                    _finite(v) and v > 0 for v in value), f"model.rope_scaling.{key}", value,
                    f"rope_type longrope needs {self.rope_dim // 2} finite numbers > 0, one per rotary pair")

    @staticmethod
    def _check_mla(m: MLAConfig) -> None:
        require(0 < m.kv_lora_rank <= MAX_DIM, "model.mla.kv_lora_rank", m.kv_lora_rank, f"must be in 1..{MAX_DIM:,}")
        require(m.q_lora_rank is None or 0 < m.q_lora_rank <= MAX_DIM, "model.mla.q_lora_rank", m.q_lora_rank,
                f"must be None or in 1..{MAX_DIM:,}")
        require(0 < m.qk_rope_head_dim <= MAX_HEAD_DIM and m.qk_rope_head_dim % 2 == 0, "model.mla.qk_rope_head_dim",
                m.qk_rope_head_dim, f"must be a positive even number, at most {MAX_HEAD_DIM:,}")
        require(0 <= m.qk_nope_head_dim <= MAX_HEAD_DIM, "model.mla.qk_nope_head_dim", m.qk_nope_head_dim,
                f"must be in 0..{MAX_HEAD_DIM:,}")
        require(0 < m.v_head_dim <= MAX_HEAD_DIM, "model.mla.v_head_dim", m.v_head_dim,
                f"must be in 1..{MAX_HEAD_DIM:,}")
        if m.index_topk is None:
            return
        require(0 < m.index_topk and m.q_lora_rank is not None, "model.mla.index_topk", m.index_topk,
                "must be None or a positive number of keys, with model.mla.q_lora_rank set (the indexer reads its "
                "query latent)")
        require(0 < m.index_n_heads <= MAX_HEADS, "model.mla.index_n_heads", m.index_n_heads,
                f"must be in 1..{MAX_HEADS:,}")
        require(m.qk_rope_head_dim <= m.index_head_dim <= MAX_HEAD_DIM, "model.mla.index_head_dim", m.index_head_dim,
                f"must be in {m.qk_rope_head_dim}..{MAX_HEAD_DIM:,} (its first qk_rope_head_dim dims are rotated)")

    def _check_linear_attention(self, la: LinearAttentionConfig) -> None:
        require(_layer_list(la.layers, self.n_layers) and (self.mla is None or la.kind == "kda"),
                "model.linear_attention.layers", la.layers,
                f"must be distinct layer indices in 0..{self.n_layers - 1} (and no model.mla but with kind kda)")
        for key, top in (("n_key_heads", MAX_HEADS), ("n_value_heads", MAX_HEADS), ("key_head_dim", MAX_HEAD_DIM),
                         ("value_head_dim", MAX_HEAD_DIM), ("conv_width", 64), ("chunk_size", MAX_SEQ_LEN)):
            require(0 < getattr(la, key) <= top, f"model.linear_attention.{key}", getattr(la, key),
                    f"must be an integer in 1..{top:,}")
        require(la.n_value_heads % la.n_key_heads == 0, "model.linear_attention.n_value_heads", la.n_value_heads,
                f"must be a multiple of n_key_heads={la.n_key_heads}")
        require(la.conv_width >= 2, "model.linear_attention.conv_width", la.conv_width, "must be at least 2")
        require(la.projections in ("grouped", "split"), "model.linear_attention.projections", la.projections,
                "must be grouped (Qwen3-Next) or split (Qwen3.5)")
        require(la.kind in ("gated_deltanet", "kda"), "model.linear_attention.kind", la.kind,
                "must be gated_deltanet (Qwen3-Next, Qwen3.5) or kda (Kimi Linear)")
        require(la.kind != "kda" or (la.n_value_heads == la.n_key_heads and la.value_head_dim == la.key_head_dim),
                "model.linear_attention.kind", la.kind, f"kda needs n_value_heads = n_key_heads and value_head_dim = "
                f"key_head_dim (they are {la.n_value_heads}, {la.n_key_heads}, {la.value_head_dim}, {la.key_head_dim})")

    def _check_sublayers(self) -> None:
        kinds = self.sublayers
        require(kinds is None or (isinstance(kinds, list) and len(kinds) == self.n_layers
                                  and all(k in SUBLAYERS for k in kinds)), "model.sublayers", kinds,
                f"None or a list of n_layers={self.n_layers} entries, each one of {', '.join(SUBLAYERS)}")
        mamba = kinds is not None and "mamba" in kinds
        require(mamba == (self.mamba is not None), "model.mamba", self.mamba,
                "set exactly when model.sublayers has mamba layers")
        require(kinds is None or (self.mla is None and self.linear_attention is None), "model.sublayers", kinds,
                "one sublayer per layer is built without model.mla and linear_attention")
        moe = [i for i, k in enumerate(kinds or []) if k == "moe"]
        require(kinds is None or moe == self.moe_layers, "model.moe", self.moe, f"placed exactly on the moe "
                f"sublayers {moe} (model.moe.dense_layers the others) when model.sublayers is set")

    @staticmethod
    def _check_mamba(m: Mamba2Config) -> None:
        for key, top in (("n_heads", MAX_HEADS), ("head_dim", MAX_HEAD_DIM), ("state_size", MAX_HEAD_DIM),
                         ("conv_width", 64), ("chunk_size", MAX_SEQ_LEN)):
            require(0 < getattr(m, key) <= top, f"model.mamba.{key}", getattr(m, key),
                    f"must be an integer in 1..{top:,}")
        require(0 < m.n_groups and m.n_heads % m.n_groups == 0, "model.mamba.n_groups", m.n_groups,
                f"must divide n_heads={m.n_heads}")
        require(m.conv_width >= 2, "model.mamba.conv_width", m.conv_width, "must be at least 2")
        require(_finite(m.dt_min) and m.dt_min >= 0, "model.mamba.dt_min", m.dt_min, "must be a finite number >= 0")

    @staticmethod
    def _check_moe_router(e: MoEConfig) -> None:
        """The experts' count and how tokens are routed to them (top-k, groups, scores)."""
        require(0 < e.num_experts <= MAX_EXPERTS, "model.moe.num_experts", e.num_experts,
                f"must be in 1..{MAX_EXPERTS:,}")
        require(0 < e.top_k <= e.num_experts, "model.moe.top_k", e.top_k, f"must be in 1..num_experts={e.num_experts}")
        require(0 < e.ffn_dim <= MAX_FFN_DIM, "model.moe.ffn_dim", e.ffn_dim, f"must be in 1..{MAX_FFN_DIM:,}")
        require(e.layer_freq > 0, "model.moe.layer_freq", e.layer_freq, "must be > 0")
        require(e.score_func in ("softmax", "sigmoid"), "model.moe.score_func", e.score_func, "one of softmax, sigmoid")
        require(e.n_groups > 0 and e.num_experts % e.n_groups == 0, "model.moe.n_groups", e.n_groups,
                f"must divide num_experts={e.num_experts}")
        require(0 < e.topk_groups <= e.n_groups, "model.moe.topk_groups", e.topk_groups,
                f"must be in 1..n_groups={e.n_groups}")
        require(e.n_groups == 1 or e.num_experts // e.n_groups >= 2, "model.moe.n_groups", e.n_groups,
                "each group needs at least 2 experts (groups are ranked by their top-2 sum)")
        require(not e.gate_input or e.top_k == 1, "model.moe.gate_input", e.gate_input,
                f"needs top_k=1 (Llama 4 scales each token by its one expert's gate), not {e.top_k}")
        require(e.n_groups == 1 or e.top_k <= e.topk_groups * e.num_experts // e.n_groups,
                "model.moe.top_k", e.top_k, "must not exceed the experts of the kept groups")

    @staticmethod
    def _check_moe_experts(e: MoEConfig) -> None:
        """Capacity, scaling, dropping, the auxiliary losses' weights and the shared expert."""
        require(e.capacity_factor is None or (_finite(e.capacity_factor) and e.capacity_factor > 0),
                "model.moe.capacity_factor", e.capacity_factor, "must be None (dropless) or a finite number > 0")
        require(_finite(e.scaling_factor) and e.scaling_factor > 0, "model.moe.scaling_factor", e.scaling_factor,
                "must be a finite number > 0")
        require(e.drop_policy in ("probs", "position"), "model.moe.drop_policy", e.drop_policy,
                "one of probs, position")
        for key in ("jitter_eps", "aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(e, key)
            require(_finite(value) and value >= 0, f"model.moe.{key}", value, "must be a finite number >= 0")
        require(0 < e.sinkhorn_iters <= MAX_SINKHORN_ITERS, "model.moe.sinkhorn_iters", e.sinkhorn_iters,
                f"must be in 1..{MAX_SINKHORN_ITERS:,}")
        require(e.expert_activation in ("swiglu", "clamped_swiglu", "relu2"), "model.moe.expert_activation",
                e.expert_activation, "one of swiglu, clamped_swiglu, relu2")
        for key in ("swiglu_alpha", "swiglu_limit"):
            require(_finite(getattr(e, key)) and getattr(e, key) > 0, f"model.moe.{key}", getattr(e, key),
                    "must be a finite number > 0")
        require(0 <= e.shared_ffn_dim <= MAX_FFN_DIM, "model.moe.shared_ffn_dim", e.shared_ffn_dim,
                f"must be in 0..{MAX_FFN_DIM:,} (0 = none)")

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model key(s) {unknown}; allowed: {sorted(known)}")
        d = dict(d)
        for key, sub in (("moe", MoEConfig), ("mla", MLAConfig), ("linear_attention", LinearAttentionConfig),
                         ("mamba", Mamba2Config)):
            if isinstance(d.get(key), dict):
                sub_known = {f.name for f in dataclasses.fields(sub)}
                bad = sorted(set(d[key]) - sub_known)
                if bad:
                    raise ConfigError(f"unknown model.{key} key(s) {bad}; allowed: {sorted(sub_known)}")
                d[key] = sub(**d[key])
        return cls(**d)
