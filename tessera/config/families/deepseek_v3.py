"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention without biases; sigmoid routing
over groups of experts with a selection bias (e_score_correction_bias) and a scaling factor, shared
experts, and dense MLPs in the first `first_k_dense_replace` layers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.moe import MoEFamily

_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@dataclass(frozen=True)
class DeepseekV3(MoEFamily):
    """DeepSeek-V3's latent attention fields and expert fields (n_routed_experts, groups, scaling,
    shared experts as a multiple of one expert)."""

    mla: ClassVar[bool] = True
    mtp_layers: ClassVar[bool] = True
    sparse_attention: ClassVar[bool] = False  # the lightning indexer (model.mla.index_topk): deepseek_v32.py

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().attention_from_hf(d)
        if fields["qkv_bias"]:
            raise ModelError("attention_bias=true is not supported for deepseek_v3")
        fields["head_dim"] = None
        fields["mla"] = dict(q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
                             qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
                             v_head_dim=d["v_head_dim"], rope_interleave=bool(d.get("rope_interleave", True)))
        return fields

    def moe_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        return dict(num_experts=d["n_routed_experts"], top_k=d["num_experts_per_tok"],
                    ffn_dim=d["moe_intermediate_size"], first_k_dense=d.get("first_k_dense_replace", 0),
                    score_func="sigmoid", norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                    scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                    n_groups=d.get("n_group", 1) or 1, topk_groups=d.get("topk_group", 1) or 1, expert_bias=True,
                    shared_ffn_dim=d["moe_intermediate_size"] * (d.get("n_shared_experts") or 0))

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        self.check_no_window(cfg)
        self.check_qk_norm(cfg)  # the latent attention has no biases: attention_bias is written with its shapes

    def moe_to_hf(self, cfg, d: dict[str, Any]) -> None:
        """The latent attention's and the experts' fields, in one block as transformers writes them."""
        e, m = cfg.moe, cfg.mla
        if m.index_topk is not None and not self.sparse_attention:
            raise ModelError(f"{self.name} has no sparse attention (model.mla.index_topk={m.index_topk}); export it as "
                             "deepseek_v32")
        if e.shared_ffn_dim % e.ffn_dim:
            raise ModelError("deepseek_v3 needs moe.shared_ffn_dim to be a multiple of moe.ffn_dim")
        d.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                 qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave,
                 n_routed_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.ffn_dim,
                 n_shared_experts=e.shared_ffn_dim // e.ffn_dim, first_k_dense_replace=e.first_k_dense,
                 n_group=e.n_groups, topk_group=e.topk_groups, routed_scaling_factor=e.scaling_factor,
                 norm_topk_prob=e.norm_topk_prob, attention_bias=False)
        if cfg.mtp_depth:  # absent otherwise, as transformers' own export leaves the MTP layers out
            d["num_nextn_predict_layers"] = cfg.mtp_depth

    # ---- multi-token prediction: the layers after the last decoder layer ----------------------
    def tensor_names(self, cfg) -> dict[str, list[str]]:
        """The decoder's names, then each MTP depth k as `model.layers.{n_layers + k - 1}`: its
        block under the usual block names, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`."""
        names = super().tensor_names(cfg)
        for k in range(1, cfg.mtp_depth + 1):
            i, mine = cfg.n_layers + k - 1, f"mtp.{k}"
            src = f"model.layers.{i}"
            for n in ("enorm", "hnorm", "eh_proj"):
                names[f"{mine}.{n}.weight"] = [f"{src}.{n}.weight"]
            block = {**self.attention_names(cfg, i), **self.ffn_names(cfg, i),
                     f"layers.{i}.attention_norm.weight": [f"{src}.input_layernorm.weight"],
                     f"layers.{i}.ffn_norm.weight": [f"{src}.post_attention_layernorm.weight"]}
            for key, hf in block.items():
                names[f"{mine}.block." + key.removeprefix(f"layers.{i}.")] = hf
            names[f"{mine}.norm.weight"] = [f"{src}.shared_head.norm.weight"]
        return names

    def tensor_copies(self, cfg) -> dict[str, str]:
        """DeepSeek-V3's files hold each MTP layer's embedding and head although they are the
        model's (`embed_tokens`, `shared_head.head`)."""
        out = {}
        for k in range(1, cfg.mtp_depth + 1):
            src = f"model.layers.{cfg.n_layers + k - 1}"
            out[f"{src}.embed_tokens.weight"] = "tok_embeddings.weight"
            out[f"{src}.shared_head.head.weight"] = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
        return out

    def check_mtp_exportable(self, cfg) -> None:
        pass  # num_nextn_predict_layers: written by moe_to_hf when mtp_depth > 0

    def moe_requirements(self, e) -> dict[str, Any]:
        return {"score_func": "sigmoid", "softmax_before_topk": True, "expert_bias": True, "layer_freq": 1,
                "dense_layers": []}


FAMILY = DeepseekV3(
    name="deepseek_v3", architecture="DeepseekV3ForCausalLM",
    int_fields=("num_experts_per_tok", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                "num_nextn_predict_layers"),
    number_fields=("routed_scaling_factor",),
    presets={
        "deepseek-v3": dict(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, ffn_dim=18432, norm_eps=1e-6,
                            max_seq_len=163840, rope_scaling=_YARN,
                            mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                     v_head_dim=128),
                            moe=dict(num_experts=256, top_k=8, ffn_dim=2048, first_k_dense=3, score_func="sigmoid",
                                     n_groups=8, topk_groups=4, scaling_factor=2.5, expert_bias=True,
                                     shared_ffn_dim=2048, seq_aux_loss_coef=1e-4)),
        # tests and the CPU demo
        "tiny-deepseek": dict(vocab_size=256, dim=64, n_layers=3, n_heads=4, ffn_dim=128, max_seq_len=256,
                              mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                       v_head_dim=16),
                              moe=dict(num_experts=8, top_k=2, ffn_dim=32, first_k_dense=1, score_func="sigmoid",
                                       n_groups=4, topk_groups=2, scaling_factor=2.5, expert_bias=True,
                                       shared_ffn_dim=32)),
    },
)
