"""Kimi Linear (KimiLinearForCausalLM, model_type kimi_linear): a hybrid decoder. Most layers mix
tokens with Kimi delta attention (model.linear_attention, kind "kda": the gated delta rule with a
decay per key channel; tessera/models/linear_attention/kimi_delta_attention.py), the others with
DeepSeek-V3's multi-head latent attention without any positional encoding (model.nope_layers: every
attention layer). The MLPs are DeepSeek-V3's: sigmoid routing with a selection bias, groups and a
scaling factor, shared experts, dense MLPs in the first `first_k_dense_replace` layers.

config.json: Moonshot's files describe the layers in `linear_attn_config` (1-based `kda_layers` and
`full_attn_layers`, `num_heads`, `head_dim`, `short_conv_kernel_size`) and the experts as
`num_experts`, `num_experts_per_token`, `num_shared_experts`, `num_expert_group`, `moe_renormalize`;
transformers' class also reads flat `layer_types` / `mlp_layer_types` / `linear_*` fields, which
take precedence. Both are read and both written.
Tensors: Moonshot's names (the MoE block `block_sparse_moe`, experts' `w1`/`w2`/`w3`, the delta
attention's three convolutions `q_conv1d` / `k_conv1d` / `v_conv1d`); a dense layer's MLP is `mlp`,
also read under `block_sparse_moe` where transformers' save_pretrained put it (`names_in_files`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.base import Family
from tessera.config.families.deepseek_v3 import DeepseekV3

LAYER_TYPES = ("linear_attention", "full_attention")
# the delta attention's tensors, by the same name in both (Tessera's under layers.{i}.attention)
KDA_TENSORS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
               "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log", "b_proj.weight",
               "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight", "o_proj.weight")
# Moonshot's config.json names -> DeepSeek-V3's, which the shared expert and MLA mapping reads
ALIASES = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
           "num_shared_experts": "n_shared_experts", "num_expert_group": "n_group",
           "moe_renormalize": "norm_topk_prob", "model_max_length": "max_position_embeddings"}
# transformers' KimiLinearConfig defaults its token ids to the published tokenizer's; a vocabulary
# without them says it has none (an export with a tokenizer writes its own: checkpoint/hf/tokenizer.py)
DEFAULT_TOKEN_IDS = {"bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839}
# transformers' spellings of the same (its attribute_map), read where Moonshot's are absent
TRANSFORMERS_ALIASES = {"num_local_experts": "n_routed_experts"}


def _linear_layers(d: Mapping[str, Any], n: int) -> list[int]:
    """The 0-based delta-attention layers: transformers' `layer_types`, else Moonshot's 1-based
    `linear_attn_config.kda_layers`, else transformers' default (attention on every 4th, from layer 4)."""
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ModelError(f"layer_types={types!r} is invalid: {n} entries, each one of {', '.join(LAYER_TYPES)}")
        return [i for i, t in enumerate(types) if t == LAYER_TYPES[0]]
    la = d.get("linear_attn_config") or {}
    if "kda_layers" in la and "full_attn_layers" in la:
        kda, full = la["kda_layers"], la["full_attn_layers"]
        if sorted(kda + full) != list(range(1, n + 1)):
            raise ModelError(f"linear_attn_config.kda_layers={kda} and full_attn_layers={full} are invalid: "
                             f"together each layer 1..{n} once")
        return [i - 1 for i in sorted(kda)]
    return [i for i in range(n) if not (i and i % 4 == 0)]


def _first_dense(d: Mapping[str, Any], n: int) -> int:
    """How many leading layers are dense: transformers' `mlp_layer_types`, else first_k_dense_replace."""
    types = d.get("mlp_layer_types")
    if types is None:
        return d.get("first_k_dense_replace", 1)
    k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if len(types) != n or any(t != "sparse" for t in types[k:]):
        raise ModelError(f"mlp_layer_types={types!r} is invalid: {n} entries, dense ones first, then sparse "
                         "(Tessera's MoE layers follow moe.first_k_dense)")
    return k


@dataclass(frozen=True)
class KimiLinear(DeepseekV3):
    hybrid: ClassVar[bool] = True
    nope: ClassVar[bool] = True
    mtp_layers: ClassVar[bool] = False

    def config_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        n = d["num_hidden_layers"]
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ModelError(f"moe_router_activation_func={d['moe_router_activation_func']!r} is not supported for "
                             "kimi_linear: its class routes by sigmoid")
        if d.get("mla_use_nope") is False:
            raise ModelError("mla_use_nope=false is not supported for kimi_linear: its class rotates no MLA layer")
        d = {**{ours: d[theirs] for theirs, ours in {**TRANSFORMERS_ALIASES, **ALIASES}.items() if theirs in d}, **d}
        d["first_k_dense_replace"] = _first_dense(d, n)
        la = d.get("linear_attn_config") or {}
        heads = d.get("linear_num_heads", la.get("num_heads", 32))
        head_dim = d.get("linear_head_dim", la.get("head_dim", 128))
        linear = _linear_layers(d, n)
        fields = super().config_from_hf(d)
        fields["mla"]["rope_interleave"] = False  # unrotated: the flag means nothing, one value round-trips
        return fields | dict(
            nope_layers=[i for i in range(n) if i not in linear],
            linear_attention=dict(layers=linear, n_key_heads=heads, n_value_heads=heads, key_head_dim=head_dim,
                                  value_head_dim=head_dim, kind="kda",
                                  conv_width=d.get("linear_conv_kernel_dim", la.get("short_conv_kernel_size", 4))))

    def config_to_hf(self, cfg) -> dict[str, Any]:
        la = cfg.linear_attention
        d = super().config_to_hf(cfg)
        for key in ("rope_interleave", "rope_scaling", "head_dim", "num_nextn_predict_layers"):
            d.pop(key, None)
        for theirs, ours in ALIASES.items():
            d[theirs] = d.pop(ours)
        d.update(mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1,
                 linear_attn_config={"kda_layers": [i + 1 for i in la.layers],
                                     "full_attn_layers": [i + 1 for i in range(cfg.n_layers) if i not in la.layers],
                                     "num_heads": la.n_key_heads, "head_dim": la.key_head_dim,
                                     "short_conv_kernel_size": la.conv_width})
        d["layer_types"] = [LAYER_TYPES[0] if i in la.layers else LAYER_TYPES[1] for i in range(cfg.n_layers)]
        d["mlp_layer_types"] = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.n_layers)]
        d.update({k: None for k, v in DEFAULT_TOKEN_IDS.items() if v >= cfg.vocab_size})
        return d

    def check_exportable(self, cfg) -> None:
        super().check_exportable(cfg)
        la = cfg.linear_attention
        attention = [i for i in range(cfg.n_layers) if not cfg.is_linear_attention_layer(i)]
        if la is None or la.kind != "kda" or sorted(cfg.nope_layers) != attention or cfg.mla is None:
            raise ModelError("kimi_linear needs model.linear_attention with kind kda, model.mla, and every attention "
                             f"layer in model.nope_layers (they are {attention}; model.nope_layers={cfg.nope_layers})")
        if cfg.attention_output_gate or cfg.norm_unit_offset:
            raise ModelError("kimi_linear has no attention output gate or (1 + w) norms; export it as qwen3_next")

    def check_mtp_exportable(self, cfg) -> None:
        Family.check_mtp_exportable(self, cfg)

    def attention_names(self, cfg, i: int) -> dict[str, list[str]]:
        if not cfg.is_linear_attention_layer(i):
            return super().attention_names(cfg, i)
        return {f"layers.{i}.attention.{n}": [f"model.layers.{i}.self_attn.{n}"] for n in KDA_TENSORS}

    def names_in_files(self, cfg, names: dict[str, list[str]], stored: set[str]) -> dict[str, list[str]]:
        """A dense layer's MLP under `block_sparse_moe` where the files keep it there (transformers'
        save_pretrained renames every `mlp` so)."""
        out = {}
        for key, hf in names.items():
            moved = [h.replace(".mlp.", ".block_sparse_moe.") for h in hf]
            out[key] = moved if any(h not in stored for h in hf) and all(h in stored for h in moved) else hf
        return out


FAMILY = KimiLinear(
    name="kimi_linear", architecture="KimiLinearForCausalLM", moe_block="block_sparse_moe",
    expert_projections={"w1": "w1", "w2": "w2", "w3": "w3"},
    int_fields=("num_experts_per_tok", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                "num_experts", "num_experts_per_token", "num_shared_experts", "num_expert_group", "model_max_length",
                "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"),
    number_fields=("routed_scaling_factor",),
    presets={
        "kimi-linear-48b-a3b": dict(
            vocab_size=163840, dim=2304, n_layers=27, n_heads=32, ffn_dim=9216, norm_eps=1e-5, max_seq_len=1048576,
            nope_layers=[3, 7, 11, 15, 19, 23, 26],
            mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     rope_interleave=False),
            linear_attention=dict(layers=[i for i in range(27) if i not in (3, 7, 11, 15, 19, 23, 26)],
                                  n_key_heads=32, n_value_heads=32, key_head_dim=128, value_head_dim=128,
                                  conv_width=4, kind="kda"),
            moe=dict(num_experts=256, top_k=8, ffn_dim=1024, first_k_dense=1, score_func="sigmoid", n_groups=1,
                     topk_groups=1, scaling_factor=2.446, expert_bias=True, shared_ffn_dim=1024)),
        # tests and the CPU demo
        "tiny-kimi-linear": dict(
            vocab_size=256, dim=64, n_layers=4, n_heads=4, ffn_dim=128, max_seq_len=256, nope_layers=[3],
            mla=dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     rope_interleave=False),
            linear_attention=dict(layers=[0, 1, 2], n_key_heads=2, n_value_heads=2, key_head_dim=16,
                                  value_head_dim=16, conv_width=4, kind="kda"),
            moe=dict(num_experts=8, top_k=2, ffn_dim=32, first_k_dense=1, score_func="sigmoid", n_groups=1,
                     topk_groups=1, scaling_factor=2.5, expert_bias=True, shared_ffn_dim=32)),
    },
)
