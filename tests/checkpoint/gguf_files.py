"""Tiny GGUF files written the way llama.cpp's converter writes them, for the GGUF tests.

A random transformers model (LLaMA or Qwen2) is written with gguf's own `GGUFWriter`: metadata as
llama.cpp names it, the bundled byte-level BPE tokenizer as `tokenizer.ggml.*`, 1-D tensors in F32
and the matrices in the types under test (cycled through, so one file holds them all). Types gguf
can quantize (`gguf.quants.quantize`: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) quantize the
model's weights; for the K-quants, which gguf can only dequantize, the blocks are random bytes
with their fp16 scale fields set to small finite values (`random_k_blocks`): every bit pattern of
the rest of a block is a valid block, and both loaders under test read the same blocks. LLaMA's
query/key rows are stored permuted, as llama.cpp stores them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tessera.data.tokenizer import DEFAULT_TOKENIZER_DIR

LLAMA_LIKE = ("llama", "qwen2")  # the architectures tiny_hf_model makes (test_gguf_families.py: the others)
QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# ggml's K-quant super-block (256 values): its bytes, and where its fp16 scale fields are
# (ggml-common.h: block_q2_K ends with d, dmin; q3_K ends with d; q4_K / q5_K start with d, dmin;
# q6_K ends with d).
K_BLOCKS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
            "Q6_K": (210, (208,))}


def tiny_hf_model(arch: str, seed: int = 0):
    """A random transformers model whose matrices' rows are a multiple of 256 (K-quant blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=arch == "llama", bos_token_id=None, eos_token_id=0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common)).eval()


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's row order of a LLaMA query/key projection: each head's two RoPE halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator,
                    scales: tuple[float, float] = (1e-3, 4e-3)) -> np.ndarray:
    """Random valid `kind` blocks for a [rows, cols] matrix, as uint8 [rows, cols / 256 * block bytes],
    their fp16 scale fields drawn from `scales`."""
    size, scale_offsets = K_BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for offset in scale_offsets:
        scale = rng.uniform(*scales, size=(rows, cols // 256)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def _tokenizer_metadata(writer, control: dict[int, str] | None = None) -> None:
    """The bundled tokenizer as `tokenizer.ggml.*`; `control`: tokens replaced by these control tokens."""
    data = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    special = {t["id"] for t in data["added_tokens"] if t.get("special")} | set(control or {})
    for index, token in (control or {}).items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3: control
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)


def write_gguf(model, path: Path, kinds: tuple[str, ...], seed: int = 0, arch: str | None = None,
               head_count: int | None = None, extra: dict[str, np.ndarray] | None = None) -> Path:
    """`model` (a tiny_hf_model) as the GGUF file `path`, its i-th matrix in GGUF type
    `kinds[i % len(kinds)]`; `arch` overrides the architecture the metadata names, `head_count` the
    query head count it states, and `extra` adds float32 tensors by GGUF name."""
    import gguf

    cfg = model.config
    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if cfg.model_type == "llama" else gguf.MODEL_ARCH.QWEN2,
                                     cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch or cfg.model_type)
    arch = cfg.model_type
    matrices = 0
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads if head_count is None else head_count)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    _tokenizer_metadata(writer)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        w = t.detach().float().numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            w = llama_cpp_permute(w, cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads)
        name = f"{names.get_name(base)}.{suffix}"
        if w.ndim == 1:
            writer.add_tensor(name, w)
            continue
        kind = kinds[matrices % len(kinds)]
        qtype = gguf.GGMLQuantizationType[kind]
        matrices += 1
        if kind in K_BLOCKS:
            writer.add_tensor(name, random_k_blocks(kind, *w.shape, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_from_gguf(path: Path):
    """transformers' own GGUF loader: the reference model for `path`, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
