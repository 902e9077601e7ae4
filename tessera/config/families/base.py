"""What a model family is: one HuggingFace model class, described as Tessera's one `Transformer`.

A family maps a checked config.json to the fields of a `ModelConfig` and back, names the
HuggingFace tensor(s) that hold each Tessera tensor, refuses to export what its HuggingFace class
would not reproduce, and lists its named configurations (presets). `Family` is the LLaMA-style
decoder every family shares (embeddings, RMSNorm, rotary attention, SwiGLU MLP, head) with its
HuggingFace names; its fields switch what a family changes in it (attention biases, QK norm, a
sliding window), and `MoEFamily` (moe.py) adds routed experts, whose config.json fields each MoE
family maps in a subclass of its own. A family module makes one instance, `FAMILY`, which
`tessera/config/families/__init__.py` registers.

Families read a `tessera.config.model.ModelConfig` (`cfg` below) and return plain field dicts,
which `ModelConfig(**fields)` takes (`moe` and `mla` as nested dicts): `ModelConfig` validates its
`family` through the registry, so nothing here imports it. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tessera.config.errors import ModelError

# HuggingFace's names of the modules every family shares: attention, multi-head latent attention
# (DeepSeek-V2/V3 and the models built on them) and the SwiGLU MLP.
ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
MLA_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
                 "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
MLP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# HuggingFace's names of a block's RMSNorms, by where they sit (ModelConfig.block_norms): LLaMA's two
# before attention and MLP, OLMo 2's two after them, Gemma 3's four
BLOCK_NORM_NAMES = {
    "pre": {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "post": {"attention_post_norm": "post_attention_layernorm", "ffn_post_norm": "post_feedforward_layernorm"},
    "pre_post": {"attention_norm": "input_layernorm", "attention_post_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "ffn_post_norm": "post_feedforward_layernorm"},
}


def rope_from_hf(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from the legacy keys or transformers 5's `rope_parameters`."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}  # a family's own field
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta), scaling or None


@dataclass(frozen=True)
class TensorPart:
    """A Tessera tensor [..., out, in] that is part of a fused HuggingFace tensor [..., in, count * out]
    (Llama 4's experts.gate_up_proj): the `index`-th of `count` equal cuts of its last dimension,
    transposed; or, not `transposed`, of a fused tensor [..., count * out, in] (Qwen3.5 MoE's packed
    experts): the `index`-th cut of its rows. `Family.tensor_parts` names them; the loaders cut and the
    writers join them."""

    index: int
    count: int
    transposed: bool = True


# ModelConfig fields of parts only some families have, with the value every other family needs
# (Gemma 3's GeGLU, (1 + weight) norms, scaled embeddings and softmax scale; partial rotary)
OWN_PARTS = {"activation": "silu", "norm_unit_offset": False, "embed_scale": False, "query_pre_attn_scalar": None,
             "partial_rotary_factor": 1.0}
# the families to export such a part as, where others than Gemma 3 have it
OWN_PART_FAMILIES = {"partial_rotary_factor": "phi3, glm4_moe or qwen3_next",
                     "norm_unit_offset": "gemma3_text or qwen3_next"}


# config.json fields every family reads as integers / numbers (when present; checked before use)
INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "moe_intermediate_size", "max_position_embeddings")
NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")


@dataclass(frozen=True)
class Family:
    """A dense LLaMA-style HuggingFace model class, with the switches of what a family changes."""

    name: str  # config.json's model_type, and ModelConfig.family
    architecture: str  # the transformers class (config.json's "architectures")
    qkv_bias_only: bool = False  # biases on q, k, v always, none on o (Qwen2); else one attention_bias for all four
    qk_norm: bool = False  # RMSNorm on q and k, always (Qwen3); the others have none
    sliding_window: bool = False  # config.json's sliding_window applies to every layer (Mistral)
    int_fields: tuple[str, ...] = ()  # config.json fields it reads as integers, beyond INT_FIELDS
    number_fields: tuple[str, ...] = ()  # ... and as numbers, beyond NUMBER_FIELDS
    block_norms: str = "pre"  # where its blocks' RMSNorms sit (ModelConfig.block_norms)
    qk_norm_all_heads: bool = False  # with qk_norm: over all heads at once (OLMo 2), else per head (Qwen3)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> ModelConfig fields
    moe: ClassVar[bool] = False  # routed experts: its models need a model.moe section, the others must not have one
    moe_optional: ClassVar[bool] = False  # ... or may have one (Nemotron-H: its MoE variants' "moe" sublayers)
    mla: ClassVar[bool] = False  # multi-head latent attention: exports model.mla
    mtp_layers: ClassVar[bool] = False  # reads the MTP layers its files store after the last layer (DeepSeek-V3)
    nope: ClassVar[bool] = False  # layers without positional encoding (model.nope_layers): SmolLM3
    layer_windows: ClassVar[bool] = False  # a window on some layers (model.window_layers), their own RoPE: OLMo 3
    chunked_attention: ClassVar[bool] = False  # chunked local attention on the RoPE layers (Llama 4)
    hybrid: ClassVar[bool] = False  # Gated DeltaNet layers, gated attention: Qwen3-Next
    own_parts: ClassVar[tuple[str, ...]] = ()  # the OWN_PARTS fields its class expresses (the others must be default)
    one_sublayer: ClassVar[bool] = False  # layers of one sublayer each (model.sublayers, Mamba-2): Nemotron-H

    # ---- config.json -> ModelConfig fields -----------------------------------------------------
    def config_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        """The `ModelConfig` fields of config.json `d` (its fields' types already checked); refuses
        (ModelError) what Tessera cannot reproduce."""
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"hidden_act={act!r} is not supported; Tessera's MLPs are SwiGLU (silu)")
        if d.get("mlp_bias"):
            raise ModelError("mlp_bias=true is not supported (no family Tessera loads uses it)")
        theta, scaling = rope_from_hf(d)
        heads = d["num_attention_heads"]
        fields: dict[str, Any] = dict(
            family=self.name, vocab_size=d["vocab_size"], dim=d["hidden_size"], n_layers=d["num_hidden_layers"],
            n_heads=heads, n_kv_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim"),
            ffn_dim=d.get("intermediate_size") or d.get("moe_intermediate_size"),
            norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_seq_len=d.get("max_position_embeddings", 4096),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        )
        fields.update(self.attention_from_hf(d))
        return fields

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        """The attention fields: biases, QK norm, sliding window."""
        fields: dict[str, Any] = {}
        if self.qkv_bias_only:
            fields["qkv_bias"] = True
        else:
            fields["qkv_bias"] = fields["out_bias"] = bool(d.get("attention_bias", False))
        if self.qk_norm:
            fields.update(qk_norm=True, qk_norm_all_heads=self.qk_norm_all_heads)
        fields["block_norms"] = self.block_norms
        if self.sliding_window:
            fields["sliding_window"] = d.get("sliding_window")
        elif d.get("use_sliding_window"):
            raise ModelError(f"use_sliding_window=true is not supported for {self.name} (per-layer windows)")
        return fields

    # ---- ModelConfig -> config.json ------------------------------------------------------------
    def config_to_hf(self, cfg) -> dict[str, Any]:
        """config.json of `cfg` (a ModelConfig of this family), in the order transformers writes it;
        refuses (ModelError) what this family's HuggingFace class cannot express."""
        d: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.name, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
            "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
            "hidden_act": "silu",
        }
        if cfg.mla is None:
            d["head_dim"] = cfg.head_dim
        self.attention_to_hf(cfg, d)
        return d

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        """Add the attention fields to `d`: biases, sliding window; QK norm must be what the class has."""
        if self.qkv_bias_only:
            if not cfg.qkv_bias or cfg.out_bias:
                raise ModelError(f"{self.name} always has q/k/v biases and no output bias")
        else:
            if cfg.qkv_bias != cfg.out_bias:
                raise ModelError(f"{self.name} has one attention_bias for q, k, v and o; got qkv_bias={cfg.qkv_bias},"
                                 f" out_bias={cfg.out_bias}")
            d["attention_bias"] = cfg.qkv_bias
        if self.sliding_window:
            d["sliding_window"] = cfg.sliding_window
        else:
            self.check_no_window(cfg)
        self.check_qk_norm(cfg)
        if not self.layer_windows and (cfg.window_layers is not None or cfg.local_rope_theta is not None):
            raise ModelError(f"{self.name} has no per-layer windows or RoPE (model.window_layers="
                             f"{cfg.window_layers}, model.local_rope_theta={cfg.local_rope_theta}); export it as olmo3")
        if cfg.attention_chunk_size is not None and not self.chunked_attention:
            raise ModelError(f"{self.name} has no chunked attention (model.attention_chunk_size="
                             f"{cfg.attention_chunk_size}); train without it")
        if not self.hybrid and (cfg.linear_attention is not None or cfg.attention_output_gate):
            raise ModelError(f"{self.name} has no linear-attention layers or attention output gate; export it as "
                             "qwen3_next")
        if not self.one_sublayer and (cfg.sublayers is not None or cfg.mamba is not None):
            raise ModelError(f"{self.name} has no one-sublayer layers or Mamba-2 (model.sublayers={cfg.sublayers}); "
                             "export it as nemotron_h")
        if cfg.nope_layers and not self.nope:
            raise ModelError(f"{self.name} rotates every layer by RoPE (model.nope_layers={cfg.nope_layers}); "
                             "export it as smollm3, or train without NoPE layers")
        self.check_own_parts(cfg)

    def check_own_parts(self, cfg) -> None:
        """The parts only some families' classes have (OWN_PARTS) at the value this one's needs."""
        for key, default in OWN_PARTS.items():
            if key not in self.own_parts and getattr(cfg, key) != default:
                owners = OWN_PART_FAMILIES.get(key, "gemma3_text")
                raise ModelError(f"{self.name} has no such part (model.{key}={getattr(cfg, key)!r}, its class needs "
                                 f"{default!r}); export it as {owners}")
        kind = (cfg.rope_scaling or {}).get("rope_type")
        if kind == "longrope" and "rope_scaling" not in self.own_parts:
            raise ModelError(f"{self.name}'s class has no LongRoPE (model.rope_scaling.rope_type=longrope); export "
                             "it as phi3")

    def check_no_window(self, cfg) -> None:
        """A family without a sliding window cannot carry a model trained with one (its export would
        attend to every position)."""
        if cfg.sliding_window is not None:
            raise ModelError(f"{self.name} has no sliding attention window (model.sliding_window="
                             f"{cfg.sliding_window}); export it as mistral (a window on every layer) or olmo3 "
                             "(model.window_layers), or train without the window")

    def check_qk_norm(self, cfg) -> None:
        """QK norm, and the block's norms, as the class has them."""
        if self.qk_norm and not cfg.qk_norm:
            raise ModelError(f"{self.name} always has QK norm (model.qk_norm must be true)")
        if not self.qk_norm and cfg.qk_norm:
            raise ModelError(f"{self.name} has no QK norm; export to qwen3 / qwen3_moe instead")
        if cfg.qk_norm and cfg.qk_norm_all_heads != self.qk_norm_all_heads:
            raise ModelError(f"{self.name}'s QK norm is {'over all heads' if self.qk_norm_all_heads else 'per head'} "
                             f"(model.qk_norm_all_heads must be {str(self.qk_norm_all_heads).lower()})")
        if cfg.block_norms != self.block_norms:
            raise ModelError(f"{self.name}'s blocks have block_norms={self.block_norms!r} (model.block_norms="
                             f"{cfg.block_norms!r}); export it as a family whose norms sit there")

    # ---- tensor names --------------------------------------------------------------------------
    def tensor_names(self, cfg) -> dict[str, list[str]]:
        """Tessera state-dict key -> the HuggingFace key(s) that hold it, in model order. Routed
        experts are one [E, out, in] tensor in Tessera and E tensors in HuggingFace's files: their
        entry lists E keys, stacked on load and split on save."""
        names: dict[str, list[str]] = {"tok_embeddings.weight": ["model.embed_tokens.weight"]}
        for i in range(cfg.n_layers):
            names.update({f"layers.{i}.{n}.weight": [f"model.layers.{i}.{h}.weight"]
                          for n, h in BLOCK_NORM_NAMES[cfg.block_norms].items()})
            names.update(self.attention_names(cfg, i))
            names.update(self.ffn_names(cfg, i))
        names["norm.weight"] = ["model.norm.weight"]
        if not cfg.tie_embeddings:
            names["output.weight"] = ["lm_head.weight"]
        return names

    def tensor_parts(self, cfg) -> dict[str, TensorPart]:
        """Tessera key -> the part of its (one) HuggingFace tensor it is, where that is a fused
        tensor (`TensorPart`); none for most families."""
        return {}

    def fused_rows(self, cfg) -> dict[str, tuple[int, int]]:
        """Tessera keys stored as rows [start, stop) of a HuggingFace tensor that holds several of
        them (Phi-3's qkv_proj and gate_up_proj): their `tensor_names` entry names the fused tensor,
        read as a box at that row offset and written by joining the keys in model order. None for
        most families."""
        return {}

    def unpacked_names(self, cfg) -> dict[str, list[str]]:
        """Tessera keys of `tensor_parts` that some of the family's directories store unpacked instead
        (Tessera key -> its HuggingFace keys, one per expert: what transformers' `save_pretrained`
        writes for Qwen3.5 MoE); the reader takes these where the files hold them. None for most
        families."""
        return {}

    def tensor_copies(self, cfg) -> dict[str, str]:
        """HuggingFace keys that hold a copy of a Tessera tensor (HuggingFace key -> Tessera key):
        written with its value on export, not read on import. None for most families."""
        return {}

    def unread_tensor(self, cfg, key: str) -> bool:
        """Whether HuggingFace tensor `key`, stored in this family's files, is one its transformers class
        leaves unread too (none for most families)."""
        return False

    def names_in_files(self, cfg, names: dict[str, list[str]], stored: set[str]) -> dict[str, list[str]]:
        """`tensor_names` as a directory holding the HuggingFace keys `stored` spells them, where a
        family's files come in more than one spelling (Kimi Linear's dense MLPs); most have one."""
        return names

    def check_mtp_exportable(self, cfg) -> None:
        """Only a family whose HuggingFace layout names multi-token-prediction layers exports them."""
        if cfg.mtp_depth:
            raise ModelError(f"{self.name} has no HuggingFace layout for multi-token-prediction modules "
                             f"(model.mtp_depth={cfg.mtp_depth}); only deepseek_v3 stores them (its "
                             "num_nextn_predict_layers); serve the Tessera checkpoint itself instead")

    def attention_names(self, cfg, i: int) -> dict[str, list[str]]:
        src, out = f"model.layers.{i}.self_attn", {}
        if cfg.mla is not None:
            projections = ["wq"] if cfg.mla.q_lora_rank is None else ["wq_a", "q_norm", "wq_b"]
            for n in projections + ["wkv_a", "kv_norm", "wkv_b", "wo"]:
                out[f"layers.{i}.attention.{n}.weight"] = [f"{src}.{MLA_ATTENTION[n]}.weight"]
            return out
        for n, h in ATTENTION.items():
            out[f"layers.{i}.attention.{n}.weight"] = [f"{src}.{h}.weight"]
            if (cfg.qkv_bias and n != "wo") or (cfg.out_bias and n == "wo"):
                out[f"layers.{i}.attention.{n}.bias"] = [f"{src}.{h}.bias"]
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                out[f"layers.{i}.attention.{n}.weight"] = [f"{src}.{n}.weight"]
        return out

    def ffn_names(self, cfg, i: int) -> dict[str, list[str]]:
        return {f"layers.{i}.feed_forward.{n}.weight": [f"model.layers.{i}.mlp.{h}.weight"] for n, h in MLP.items()}

    # ---- export --------------------------------------------------------------------------------
    def check_exportable(self, cfg) -> None:
        """Refuse (ModelError) a model of this family whose forward pass its HuggingFace class would
        not reproduce; a model's MoE and MLA sections are checked against the family first
        (tessera.checkpoint.hf.names.check_exportable)."""
