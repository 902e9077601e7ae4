"""Tiny GGUF files of the families llama.cpp names beyond LLaMA and Qwen2 (phi3, gemma3, olmo2,
seed_oss), written
from a random transformers model the way llama.cpp's converter lays them out: its tensor names
(gguf's own tables; Phi-3's fused attn_qkv and ffn_up as HuggingFace stores them), its metadata
keys, LongRoPE's factor tables as the tensors rope_factors_long / rope_factors_short, and Gemma's
RMSNorm weights stored with the +1 HuggingFace's Gemma RMSNorm adds at run time. Every tensor is
F32, so the file's model is the transformers model exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.checkpoint.gguf_files import _tokenizer_metadata
from tests.infer.tiny_models import hf_greedy

VOCAB = 4096  # the bundled tokenizer's, written as the file's token list


def tiny_family_model(arch: str, seed: int = 0, blocks: bool = False, layer_types: list[str] | None = None):
    """A random transformers model of GGUF architecture `arch` with awkward shapes; `blocks`: every
    matrix's row a multiple of 32 values (Q8_0 blocks); `layer_types`: Gemma 3's, instead of its
    one global layer in six."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64 if blocks else 48, intermediate_size=64 if blocks else 40,
                  num_attention_heads=4 if blocks else 6,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None,
                  eos_token_id=0, pad_token_id=None)
    if arch == "phi3":  # partial rotary (6 of 8 dims), LongRoPE, a sliding window
        pairs = int(common["hidden_size"] // common["num_attention_heads"] * 0.75) // 2
        cfg = tf.Phi3Config(**common, num_hidden_layers=3, sliding_window=7, original_max_position_embeddings=16,
                            partial_rotary_factor=0.75, rope_scaling={
                                "rope_type": "longrope", "short_factor": np.linspace(1.0, 2.0, pairs).tolist(),
                                "long_factor": np.linspace(1.5, 6.5, pairs).tolist()})
        return tf.Phi3ForCausalLM(cfg).eval()
    if arch == "olmo2":
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**common, num_hidden_layers=3, rope_theta=500000.0)).eval()
    if arch == "seed_oss":  # biases on q, k, v (none on o), a head size that is not hidden / heads
        return tf.SeedOssForCausalLM(tf.SeedOssConfig(**common, num_hidden_layers=3, head_dim=12)).eval()
    # llama.cpp's Gemma 3: one global layer in six, sliding layers by base 10,000, the softmax scaled by
    # head_dim^-0.5; the global layers' base and linear scaling come from the metadata
    cfg = tf.Gemma3TextConfig(**common, num_hidden_layers=7, head_dim=12, layer_types=layer_types, sliding_window=4,
                              query_pre_attn_scalar=12,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 20000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from their zero init, so a missing or doubled +1 shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    return model


def _metadata(writer, cfg, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch in ("olmo2", "seed_oss"):
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    elif arch == "phi3":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_rope_dimension_count(int(head_dim * cfg.partial_rotary_factor))
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    else:
        writer.add_sliding_window(cfg.sliding_window)
        if getattr(cfg, "gguf_pattern", False):  # what newer converters write: one flag per layer
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])


def write_family_gguf(model, path: Path, arch: str, q8: bool = False) -> Path:
    """`model` (a tiny_family_model of `arch`) as the F32 GGUF file `path`; `q8`: its block layers'
    matrices in Q8_0."""
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch),
                                     cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    _metadata(writer, cfg, arch)
    # transformers' Gemma tokenizer adds a <mask> token unless the vocabulary has one (Gemma 3's does):
    # the bundled tokenizer's unused <|pad|> becomes it
    _tokenizer_metadata(writer, {1: "<mask>"} if arch == "gemma3" else None)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        w = t.detach().float().numpy()
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's convention
        if q8 and w.ndim == 2 and base.startswith("model.layers."):
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", w)
    if arch == "phi3":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(cfg.rope_parameters[f"{kind}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def check_convert(path: Path, hf, model_type: str, out: Path, capsys, ids: torch.Tensor) -> None:
    """`tessera convert FILE OUT` writes a directory transformers loads as `model_type`, with `hf`'s logits."""
    from transformers import AutoModelForCausalLM

    from tessera.cli import main

    assert main(["convert", str(path), str(out)]) == 0
    assert f"wrote huggingface directory {out}" in capsys.readouterr().out
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert converted.config.model_type == model_type
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


def check_served_greedy(path: Path, hf, ids: list[int], tokens: int = 14) -> None:
    """The paged engine serving the file decodes transformers' greedy tokens."""
    from tessera.checkpoint.loading import load_model, model_tokenizer
    from tessera.infer import LLM, SamplingParams

    llm = LLM(load_model(path).model, tokenizer=model_tokenizer(path), max_num_seqs=1, max_model_len=48,
              block_size=4)
    got = llm.generate([ids], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == hf_greedy(hf, ids, tokens)


def window_ids() -> torch.Tensor:
    """Two rows of 23 token ids, longer than the tiny models' windows (seeded)."""
    return torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(0))
