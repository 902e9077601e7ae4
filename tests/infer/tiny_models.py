"""Tiny random HuggingFace models with a character-level tokenizer, written to real directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from tests.models.hf_families import random_hf_model  # noqa: F401  (re-exported for the infer tests)

VOCAB = 128
SPECIALS = ["<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")


def char_tokenizer() -> Tokenizer:
    """One token per character: 3 specials, printable ASCII, newline, then Latin-1 letters up to VOCAB."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    chars += [chr(c) for c in range(192, 192 + VOCAB - len(SPECIALS) - len(chars))]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def save_tokenizer(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    char_tokenizer().save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def hf_config(family: str, **overrides):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0,
                  eos_token_id=1, tie_word_embeddings=False)
    common.update(overrides)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if family == "mistral":
        return tf.MistralConfig(**{"sliding_window": 6, **common})
    if family == "qwen2":  # q/k/v with biases
        return tf.Qwen2Config(**common)
    if family == "smollm3":  # the second layer without RoPE (NoPE)
        return tf.SmolLM3Config(**{"no_rope_layers": [1, 0], "pad_token_id": None, **common})
    if family == "olmo2":  # norms after attention and MLP, QK norm over all heads
        return tf.Olmo2Config(**{"pad_token_id": None, **common})
    if family == "olmo3":  # the first layer in a window of 5 with its own RoPE base, YaRN on the second
        rope = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                   "rope_theta": 20000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}
        return tf.Olmo3Config(**{"pad_token_id": None, "sliding_window": 5, "layer_types": [
            "sliding_attention", "full_attention"], "rope_parameters": rope, **common})
    if family == "seed_oss":  # biases on q, k and v, none on o
        return tf.SeedOssConfig(**{"pad_token_id": None, "head_dim": 8, **common})
    if family == "exaone4":  # the first layer in a window of 5 with RoPE, the second global without
        return tf.Exaone4Config(**{"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
                                   **common})
    if family == "llama4_text":  # layer 0 in chunks of 5 with RoPE and QK norm, layer 1 NoPE with its experts
        return tf.Llama4TextConfig(**common, num_local_experts=3, interleave_moe_layer_step=2, attention_chunk_size=5,
                                   no_rope_layers=[1, 0], floor_scale=4, attn_scale=0.5, intermediate_size_mlp=40,
                                   pad_token_id=None)
    if family == "phi3":  # fused projections, a window of 6, partial rotary; LongRoPE's long table from position 2
        return tf.Phi3Config(**{"pad_token_id": None, "sliding_window": 6, "partial_rotary_factor": 0.5,
                                "original_max_position_embeddings": 2, "rope_scaling": {
                                    "rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [1.5, 4.0]},
                                **common})
    if family == "gemma3_text":  # a window of 5 with its own RoPE base on the first layer, linear scaling on the second
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}
        return tf.Gemma3TextConfig(**{"pad_token_id": None, "sliding_window": 5, "head_dim": 8,
                                      "query_pre_attn_scalar": 12, "layer_types": ["sliding_attention",
                                                                                   "full_attention"],
                                      "rope_parameters": rope, **common})
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                 head_dim=16, norm_topk_prob=True)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, moe_intermediate_size=16,
                                   n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                   first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
                                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    if family == "glm4_moe":  # RoPE on half of each head, q/k/v biases, QK norm, grouped sigmoid routing
        return tf.Glm4MoeConfig(**common, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, head_dim=12)
    if family == "gpt_oss":  # sinks, a window of 5 on the first layer, biased experts with the clamped SwiGLU, YaRN
        own = {**common, "intermediate_size": 16, "sliding_window": 5, **overrides}
        return tf.GptOssConfig(**own, num_local_experts=4, num_experts_per_tok=2, head_dim=12,
                               layer_types=["sliding_attention", "full_attention"],
                               swiglu_limit=1.0, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 64, "truncate": False, "rope_theta": 5000.0})
    raise ValueError(family)


def write_model(path: Path, family: str = "llama", seed: int = 0, std: float = 0.08, **overrides):
    """Save a random model of `family` and the tokenizer to `path`; returns the HuggingFace model."""
    model = random_hf_model(hf_config(family, **overrides), seed, std)
    model.save_pretrained(path)
    save_tokenizer(path)
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HuggingFace `generate`, greedy, never stopping early: the completion's token ids. (No
    `min_new_tokens`: that would forbid the end-of-sequence token instead of ignoring it.)"""
    ids = torch.tensor([prompt_ids])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
