"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 (deepseek_v3.py) whose latent attention runs
over the keys a lightning indexer picks (tessera/models/attention_variants/sparse_mla.py; model.mla.index_topk,
index_n_heads, index_head_dim from config.json's fields of the same names). Its class always has a
query latent (q_lora_rank) and interleaved rotary pairs (no rope_interleave field); the indexer's
tensors sit under `self_attn.indexer`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.deepseek_v3 import _YARN, DeepseekV3

INDEX_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")
INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


@dataclass(frozen=True)
class DeepseekV32(DeepseekV3):
    sparse_attention: ClassVar[bool] = True

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        if d.get("q_lora_rank") is None:
            raise ModelError("q_lora_rank=None is not supported for deepseek_v32: its indexer reads the query latent")
        fields = super().attention_from_hf(d)
        defaults = {"index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}  # transformers' defaults
        fields["mla"].update({k: d.get(k, v) for k, v in defaults.items()}, rope_interleave=True)
        return fields

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        m = cfg.mla
        if m.index_topk is None or not m.rope_interleave:
            raise ModelError(f"deepseek_v32 has the indexer and interleaved RoPE (model.mla.index_topk="
                             f"{m.index_topk}, model.mla.rope_interleave={m.rope_interleave}); export it as "
                             "deepseek_v3")
        super().moe_to_hf(cfg, d)
        del d["rope_interleave"]
        d.update({k: getattr(m, k) for k in INDEX_FIELDS})

    def attention_names(self, cfg, i: int) -> dict[str, list[str]]:
        out = super().attention_names(cfg, i)
        for n in INDEXER_TENSORS:
            out[f"layers.{i}.attention.indexer.{n}"] = [f"model.layers.{i}.self_attn.indexer.{n}"]
        return out


_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            index_topk=2048, index_n_heads=64, index_head_dim=128)

FAMILY = DeepseekV32(
    name="deepseek_v32", architecture="DeepseekV32ForCausalLM",
    int_fields=("num_experts_per_tok", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                "num_nextn_predict_layers") + INDEX_FIELDS,
    number_fields=("routed_scaling_factor",),
    presets={
        # deepseek-ai/DeepSeek-V3.2-Exp's config.json
        "deepseek-v3.2": dict(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, ffn_dim=18432, norm_eps=1e-6,
                              max_seq_len=163840, rope_scaling=_YARN, mla=_MLA,
                              moe=dict(num_experts=256, top_k=8, ffn_dim=2048, first_k_dense=3, score_func="sigmoid",
                                       n_groups=8, topk_groups=4, scaling_factor=2.5, expert_bias=True,
                                       shared_ffn_dim=2048, seq_aux_loss_coef=1e-4)),
        # tests and the CPU demo: 8 keys per query, so sparsity cuts in from the ninth token
        "tiny-deepseek-v32": dict(vocab_size=256, dim=64, n_layers=3, n_heads=4, ffn_dim=128, max_seq_len=256,
                                  mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                           v_head_dim=16, index_topk=8, index_n_heads=4, index_head_dim=16),
                                  moe=dict(num_experts=8, top_k=2, ffn_dim=32, first_k_dense=1, score_func="sigmoid",
                                           n_groups=4, topk_groups=2, scaling_factor=2.5, expert_bias=True,
                                           shared_ffn_dim=32)),
    },
)
