"""Tiny GGUF files of smollm3, exaone4, glm4moe and gpt-oss, written from a random transformers model
the way llama.cpp's converter lays them out:
- SmolLM3: LLaMA's tensors, query / key rows permuted as llama.cpp stores LLaMA's.
- EXAONE 4: Llama 3's RoPE scaling as the table `rope_freqs` (one divisor per rotary pair, from
  llama.cpp's formula, written out here) and its sliding layers as one flag per layer.
- GLM-4.5: experts stacked into one [E, out, in] tensor per projection (`ffn_*_exps`), the routing
  bias as `exp_probs_b.bias`, and one multi-token-prediction block past the model's layers that the
  reader must skip.
- Llama 4: transformers' fused experts cut into gate, up and down [E, out, in]; its Llama 3 scaling
  as `rope_freqs`; the chunk size, NoPE period and temperature llama.cpp fixes (8,192, 4, 0.1).
- Qwen3-Next: every norm but the DeltaNet's stored +1, A as -exp(A_log), dt_bias as `ssm_dt.bias`, the
  conv kernel squeezed, in_proj_qkvz (per key head q, k, v, z) cut into `attn_qkv` (all q, all k,
  all v) and `attn_gate` (z); experts stacked as GLM-4.5's; the DeltaNet sizes as `ssm.*` metadata.
- Qwen3.5 (`qwen35`, `qwen35moe`): Qwen3-Next's conventions with the DeltaNet projections apart
  (`attn_qkv` [q | k | v], `attn_gate` z, `ssm_beta`, `ssm_alpha`), and every value-head dimension
  (v's rows of attn_qkv and its conv channels, z, a, b, A, dt_bias, out_proj's columns) moved from
  HuggingFace's order grouped by key head to llama.cpp's tiled order; the MoE's packed experts cut into
  gate, up and down; no `feed_forward_length` for the MoE (its class has no dense MLP).
- gpt-oss: gate and up cut out of transformers' interleaved fused tensor and stored apart,
  transposed to [E, out, in], with their biases; the down projection transposed; the sinks as
  `attn_sinks.weight`; `mxfp4`: the expert matrices in MXFP4 (the transformers model's expert weights
  replaced by what MXFP4 holds, so both models compute with the same numbers).
Every other tensor is F32."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from tests.checkpoint.gguf_family_files import VOCAB
from tests.checkpoint.gguf_files import K_BLOCKS, _tokenizer_metadata, llama_cpp_permute, random_k_blocks

ARCHS = {"smollm3": "smollm3", "exaone4": "exaone4", "glm4moe": "glm4_moe", "gpt-oss": "gpt_oss",
         "llama4": "llama4_text", "qwen3next": "qwen3_next", "qwen35": "qwen3_5_text",
         "qwen35moe": "qwen3_5_moe_text"}
# EXAONE 4's Llama 3 scaling: with head_dim 12 and base 10,000 two of the six pairs lie between the bounds
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0,
          "original_max_position_embeddings": 1024, "rope_theta": 10000.0}


def tiny_model(arch: str, seed: int = 0, wide: bool = False, experts_width: int = 0):
    """`wide` (Qwen3.5): every matrix 64 columns wide (Q8_0 takes rows of 32) and 4 value heads of 16;
    `experts_width` (GLM-4.5, Llama 4, Qwen3.5-MoE): the model dim and the experts' hidden dim that many (256: a
    K-quant super-block a row)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_attention_heads=6, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0,
                  pad_token_id=None)
    if wide:
        common.update(hidden_size=64, intermediate_size=64, num_attention_heads=4)
    if experts_width:
        common.update(hidden_size=experts_width)
    if arch == "smollm3":  # layer 3 without RoPE
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**common, num_hidden_layers=5, rope_theta=20000.0))
    elif arch == "exaone4":
        cfg = tf.Exaone4Config(**common, num_hidden_layers=4, head_dim=12, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                            "full_attention"], rope_parameters=dict(LLAMA3))
        model = tf.Exaone4ForCausalLM(cfg)
    elif arch == "llama4":  # layers 1 and 3 routed, layer 3 without RoPE
        cfg = tf.Llama4TextConfig(**{**common, "intermediate_size": experts_width or 16}, intermediate_size_mlp=40,
                                  num_hidden_layers=4, head_dim=12, num_local_experts=4, num_experts_per_tok=1,
                                  interleave_moe_layer_step=2,
                                  attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True,
                                  floor_scale=8192, attn_scale=0.1, rope_parameters=dict(LLAMA3))
        model = tf.Llama4ForCausalLM(cfg)
    elif arch == "qwen3next":  # layers 0-2 Gated DeltaNet (2 key heads, 4 value heads), layer 3 gated attention
        cfg = tf.Qwen3NextConfig(**common, num_hidden_layers=4, head_dim=16, partial_rotary_factor=0.25,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, shared_expert_intermediate_size=24)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif arch in ("qwen35", "qwen35moe"):  # as Qwen3-Next's: layers 0-2 DeltaNet, 2 key heads of 4 value heads
        linear = dict(num_hidden_layers=4, head_dim=16, partial_rotary_factor=0.25, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16 if wide else 8,
                      linear_value_head_dim=16 if wide else 12)
        if arch == "qwen35":
            model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**common, **linear))
        else:
            model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(
                **common, **linear, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=experts_width or 16,
                shared_expert_intermediate_size=24))
    elif arch == "glm4moe":
        cfg = tf.Glm4MoeConfig(**common, num_hidden_layers=3, head_dim=12, partial_rotary_factor=0.5,
                               attention_bias=True, use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=experts_width or 16, n_shared_experts=1, first_k_dense_replace=1,
                               routed_scaling_factor=2.5, n_group=1, topk_group=1)
        model = tf.Glm4MoeForCausalLM(cfg)
    else:  # gpt-oss: MXFP4 needs rows of 32 values, so the hidden size and the experts' width are 64 and 32
        cfg = tf.GptOssConfig(**{**common, "hidden_size": 64, "intermediate_size": 32}, num_hidden_layers=3,
                              head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
        model = tf.GptOssForCausalLM(cfg)
    with torch.no_grad():  # norms, sinks and the routing bias away from their constant init
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "sinks", "e_score_correction_bias", "dt_bias")):
                p.normal_(0, 0.5) if "norm" not in name else p.normal_(1, 0.2)
    return model.eval()


def rope_freqs(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's Llama 3 table: one divisor per rotary pair."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _metadata(writer, cfg, arch: str, blocks: int) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(blocks)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    if arch not in ("llama4", "qwen35moe"):
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "smollm3":
        writer.add_rope_dimension_count(head_dim)
    elif arch in ("qwen3next", "qwen35", "qwen35moe"):
        _qwen3next_metadata(writer, cfg, head_dim, experts=arch != "qwen35")
    elif arch == "llama4":
        writer.add_feed_forward_length(cfg.intermediate_size_mlp)  # the dense layers' (replaces the one above)
        writer.add_rope_dimension_count(head_dim)
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_interleave_moe_layer_step(cfg.interleave_moe_layer_step)
    elif arch == "exaone4":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    elif arch == "glm4moe":
        writer.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        writer.add_expert_count(cfg.n_routed_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_count(cfg.n_shared_experts)
        writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
        writer.add_nextn_predict_layers(1)
    else:
        import gguf

        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_sliding_window(cfg.sliding_window)
        yarn = cfg.rope_parameters
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])


def _qwen3next_metadata(writer, cfg, head_dim: int, experts: bool) -> None:
    writer.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.model_type != "qwen3_next":  # llama.cpp writes Qwen3.5's multimodal RoPE sections, text or not
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_full_attention_interval(cfg.layer_types.index("full_attention") + 1)  # layers 0-2 linear, 3 full


def _qwen3next_tensor(cfg, layer: str, base: str, suffix: str, w: np.ndarray):
    """llama.cpp's Qwen3-Next layout of one of its tensors (not the experts)."""
    if base.endswith("linear_attn.in_proj_qkvz"):  # [k heads x (q, k, v, z)] -> all q, all k, all v; z
        k_heads, qk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        v = cfg.linear_num_value_heads // k_heads * cfg.linear_value_head_dim
        g = w.reshape(k_heads, 2 * qk + 2 * v, -1)
        parts = [g[:, :qk], g[:, qk:2 * qk], g[:, 2 * qk:2 * qk + v]]
        yield f"blk.{layer}.attn_qkv", "weight", np.concatenate([p.reshape(-1, w.shape[-1]) for p in parts])
        yield f"blk.{layer}.attn_gate", "weight", g[:, 2 * qk + v:].reshape(-1, w.shape[-1])
    elif suffix == "A_log":
        yield f"blk.{layer}.ssm_a", "weight", -np.exp(w)
    elif suffix == "dt_bias":
        yield f"blk.{layer}.ssm_dt", "bias", w
    elif base.endswith("conv1d"):
        yield base, suffix, w.squeeze(1)
    elif base.endswith("norm") and not base.endswith("linear_attn.norm"):
        yield base, suffix, w + 1
    else:
        yield base, suffix, w


def _tiled(w: np.ndarray, cfg, axis: int, head: int) -> np.ndarray:
    """llama.cpp's Qwen3.5 value-head order along `axis`: HuggingFace's heads grouped by key head
    [k heads, v per k, head] stored as [v per k, k heads, head]."""
    k_heads = cfg.linear_num_key_heads
    shape = w.shape
    grouped = w.reshape(*shape[:axis], k_heads, -1, head, *shape[axis + 1:])
    return np.swapaxes(grouped, axis, axis + 1).reshape(shape)


def _qwen35_tensor(cfg, layer: str, base: str, suffix: str, w: np.ndarray):
    """llama.cpp's Qwen3.5 layout of one tensor (not the experts): value heads tiled, then Qwen3-Next's conventions."""
    qk, vd = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim
    part = base.rpartition(".")[2]
    if part == "in_proj_qkv":
        yield f"blk.{layer}.attn_qkv", suffix, np.concatenate([w[:qk], _tiled(w[qk:], cfg, 0, vd)])
    elif part == "in_proj_z":
        yield f"blk.{layer}.attn_gate", suffix, _tiled(w, cfg, 0, vd)
    elif part in ("in_proj_a", "in_proj_b"):
        yield f"blk.{layer}.ssm_{'alpha' if part == 'in_proj_a' else 'beta'}", suffix, _tiled(w, cfg, 0, 1)
    elif part == "out_proj" and ".linear_attn." in base:
        yield f"blk.{layer}.ssm_out", suffix, _tiled(w, cfg, 1, vd)
    elif suffix in ("A_log", "dt_bias"):
        yield from _qwen3next_tensor(cfg, layer, base, suffix, _tiled(w, cfg, 0, 1))
    elif part == "conv1d":
        yield base, suffix, np.concatenate([w[:qk], _tiled(w[qk:], cfg, 0, vd)]).squeeze(1)
    else:
        yield from _qwen3next_tensor(cfg, layer, base, suffix, w)


def _gguf_tensors(model, arch: str):
    """(GGUF base name or HuggingFace module, suffix, float32 array) of every tensor, llama.cpp's layout."""
    cfg = model.config
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = t.detach().float().numpy()
        base, _, suffix = hf_name.rpartition(".")
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if arch == "smollm3" and base.endswith(("q_proj", "k_proj")):
            w = llama_cpp_permute(w, cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads)
        if hf_name.endswith("self_attn.sinks"):
            yield f"blk.{layer}.attn_sinks", "weight", w
        elif hf_name.endswith("e_score_correction_bias"):
            yield f"blk.{layer}.exp_probs_b", "bias", w
        elif "feed_forward.experts." in hf_name:  # Llama 4: gate_up [E, in, 2 x ff], down [E, ff, in]
            w = w.swapaxes(-1, -2)
            if base.endswith("gate_up_proj") or hf_name.endswith("gate_up_proj"):
                half = w.shape[1] // 2
                yield f"blk.{layer}.ffn_gate_exps", "weight", w[:, :half]
                yield f"blk.{layer}.ffn_up_exps", "weight", w[:, half:]
            else:
                yield f"blk.{layer}.ffn_down_exps", "weight", w
        elif "mlp.experts." in hf_name:
            yield from _experts(arch, layer, hf_name.rpartition(".")[2], w)
        elif arch == "qwen3next":
            yield from _qwen3next_tensor(cfg, layer, base, suffix, w)
        elif arch in ("qwen35", "qwen35moe"):
            yield from _qwen35_tensor(cfg, layer, base, suffix, w)
        else:
            yield base, suffix, w


def _experts(arch: str, layer: str, name: str, w: np.ndarray):
    if arch in ("glm4moe", "qwen3next", "qwen35moe"):  # gate_up [E, 2 x ff, in], gate first; down [E, in, ff]
        if name == "gate_up_proj":
            half = w.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps", "weight", w[:, :half]
            yield f"blk.{layer}.ffn_up_exps", "weight", w[:, half:]
        else:
            yield f"blk.{layer}.ffn_down_exps", "weight", w
        return
    # gpt-oss: gate_up [E, in, 2 x ff] interleaved (and its bias [E, 2 x ff]); down [E, ff, in]
    kind = "bias" if name.endswith("_bias") else "weight"
    if name.startswith("gate_up_proj"):
        for part, start in (("gate", 0), ("up", 1)):
            cut = w[..., start::2]
            yield f"blk.{layer}.ffn_{part}_exps", kind, cut if kind == "bias" else cut.swapaxes(-1, -2)
    else:
        yield f"blk.{layer}.ffn_down_exps", kind, w if kind == "bias" else w.swapaxes(-1, -2)


def mxfp4_experts(model) -> None:
    """Replace the gpt-oss model's expert matrices by what MXFP4 blocks of them hold."""
    import gguf

    qtype = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")) and "experts" in name:
                stored = p.detach().float().numpy().swapaxes(-1, -2)  # as llama.cpp stores it: [E, out, in]
                back = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(stored), qtype), qtype)
                p.copy_(torch.from_numpy(back.swapaxes(-1, -2).copy()))


def write_gguf(model, path: Path, arch: str, mxfp4: bool = False, q8: bool = False,
               experts: dict[str, str] | None = None) -> Path:
    """`model` (a tiny_model of `arch`) as the GGUF file `path`; `q8`: the layers' matrices of whole
    blocks in Q8_0 (not the conv kernel); `experts`: the routed experts' gate, up and down (by those
    names) in these GGML types, the K types as random blocks of small scales (`random_k_blocks`)."""
    import gguf

    rng = np.random.default_rng(0)

    cfg = model.config
    n = cfg.num_hidden_layers
    blocks = n + 1 if arch == "glm4moe" else n
    names = gguf.get_tensor_name_map(next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), blocks)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    _metadata(writer, cfg, arch, blocks)
    _tokenizer_metadata(writer)
    for base, suffix, w in _gguf_tensors(model, arch):
        name = f"{base if base.startswith('blk.') else names.get_name(base)}.{suffix}"
        part = base.rpartition(".ffn_")[2].removesuffix("_exps") if base.endswith("_exps") else None
        if experts and part in experts and suffix == "weight":
            qtype = gguf.GGMLQuantizationType[experts[part]]
            raw = (random_k_blocks(experts[part], w.shape[0] * w.shape[1], w.shape[2], rng, (2e-5, 8e-5))
                   .reshape(*w.shape[:2], -1) if experts[part] in K_BLOCKS
                   else gguf.quants.quantize(np.ascontiguousarray(w), qtype))
            writer.add_tensor(name, raw, raw_dtype=qtype)
        elif (mxfp4 and w.ndim == 3) or (q8 and w.ndim == 2 and name.startswith("blk.") and "conv" not in name
                                       and w.shape[-1] % 32 == 0):
            qtype = gguf.GGMLQuantizationType.MXFP4 if mxfp4 else gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    if arch in ("exaone4", "llama4"):
        writer.add_tensor("rope_freqs.weight", rope_freqs(LLAMA3, 12, LLAMA3["rope_theta"]))
    if arch == "glm4moe":  # the multi-token-prediction block llama.cpp writes after the model's layers
        writer.add_tensor(f"blk.{n}.nextn.eh_proj.weight", np.ones((cfg.hidden_size, 2 * cfg.hidden_size), np.float32))
        writer.add_tensor(f"blk.{n}.attn_norm.weight", np.ones(cfg.hidden_size, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
