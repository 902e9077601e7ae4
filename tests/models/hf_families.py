"""Tiny random HuggingFace configs of every supported family, shared by the parity tests."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def hf_configs() -> dict[str, object]:
    import transformers as tf

    moe = dict(moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2)
    return {
        "llama": tf.LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 16}),
        "llama_tied_bias": tf.LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True),
        "mistral": tf.MistralConfig(**COMMON, sliding_window=5),
        "qwen2": tf.Qwen2Config(**COMMON),
        "qwen3": tf.Qwen3Config(**COMMON, head_dim=16),
        "smollm3": tf.SmolLM3Config(**COMMON, no_rope_layers=[1, 0, 1], bos_token_id=0, eos_token_id=1,
                                    pad_token_id=None),  # layer 1 without RoPE
        "olmo2": tf.Olmo2Config(**COMMON, attention_bias=True, pad_token_id=None, eos_token_id=1),
        "olmo3": tf.Olmo3Config(**COMMON, sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                "sliding_attention"], pad_token_id=None, eos_token_id=1,
                                rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                    "original_max_position_embeddings": 32,
                                                                    "attention_factor": 1.2, "rope_theta": 20000.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}),
        "seed_oss": tf.SeedOssConfig(**COMMON, head_dim=12, pad_token_id=None, eos_token_id=1),  # no bias on o
        "exaone4": tf.Exaone4Config(**COMMON, head_dim=12, sliding_window=4, layer_types=[  # layer 1 global, NoPE
            "sliding_attention", "full_attention", "sliding_attention"]),
        "exaone4_global": tf.Exaone4Config(**COMMON, sliding_window=None, layer_types=["full_attention"] * 3,
                                           tie_word_embeddings=True),  # every layer global, with RoPE
        "phi3": tf.Phi3Config(**{**COMMON, "hidden_size": 48, "intermediate_size": 40, "num_attention_heads": 6}, sliding_window=7, pad_token_id=None, eos_token_id=1, original_max_position_embeddings=8, partial_rotary_factor=0.75, rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.0], "long_factor": [1.5, 3.0, 6.5]}),  # noqa: E501
        "phi3_short": tf.Phi3Config(**{**COMMON, "max_position_embeddings": 64}, pad_token_id=None, eos_token_id=1, original_max_position_embeddings=16, rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.7, 2.5], "long_factor": [2.0, 3.0, 5.0, 9.0]}),  # noqa: E501
        "gemma3_text": tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=12, sliding_window=4, query_pre_attn_scalar=20, layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"], rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}, "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}, pad_token_id=None, bos_token_id=2, eos_token_id=1),  # noqa: E501
        "mixtral": tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "llama4_text": tf.Llama4TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=12, intermediate_size_mlp=40,
                                           num_local_experts=3, interleave_moe_layer_step=2, attention_chunk_size=5,
                                           no_rope_layers=[1, 1, 0, 1], floor_scale=4, attn_scale=0.5,
                                           pad_token_id=None, eos_token_id=1,
                                           rope_parameters={"rope_type": "llama3", "rope_theta": 20000.0,
                                                            "factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 16}),
        "qwen2_moe": tf.Qwen2MoeConfig(**COMMON, **moe, shared_expert_intermediate_size=24, norm_topk_prob=False,
                                       decoder_sparse_step=1, mlp_only_layers=[1]),
        "qwen3_moe": tf.Qwen3MoeConfig(**COMMON, **moe, head_dim=16, norm_topk_prob=True),
        "qwen3_next": tf.Qwen3NextConfig(**{**COMMON, "num_hidden_layers": 4}, **moe, head_dim=16,
                                         shared_expert_intermediate_size=24, mlp_only_layers=[2],
                                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                         linear_value_head_dim=12,
                                         partial_rotary_factor=0.5),
        "qwen3_5_text": tf.Qwen3_5TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, linear_num_key_heads=2,
                                             linear_num_value_heads=4, linear_key_head_dim=8,
                                             linear_value_head_dim=12, partial_rotary_factor=0.5),
        "qwen3_5_moe_text": tf.Qwen3_5MoeTextConfig(**{**COMMON, "num_hidden_layers": 4}, **moe, head_dim=16,
                                                    shared_expert_intermediate_size=24, linear_num_key_heads=2,
                                                    linear_num_value_heads=4, linear_key_head_dim=8,
                                                    linear_value_head_dim=12, partial_rotary_factor=0.5),
        "nemotron_h": tf.NemotronHConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, max_position_embeddings=128, layer_norm_epsilon=1e-5, mamba_num_heads=6, mamba_head_dim=5,
            ssm_state_size=7, n_groups=3, conv_kernel=3, chunk_size=4,
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"]),
        # the MoE variants (Nemotron 3): relu^2 experts routed by grouped sigmoid scores, a shared expert
        "nemotron_h_moe": tf.NemotronHConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, max_position_embeddings=128, layer_norm_epsilon=1e-5, mamba_num_heads=6, mamba_head_dim=5,
            ssm_state_size=7, n_groups=3, conv_kernel=3, chunk_size=4, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
            routed_scaling_factor=2.5,
            layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe"]),
        "deepseek_v3": tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=16,
                                           n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                           first_k_dense_replace=1, n_shared_experts=2, q_lora_rank=16,
                                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                           v_head_dim=8, routed_scaling_factor=2.5,
                                           rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32, "beta_fast": 32,
                                                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}),
        "deepseek_v32": tf.DeepseekV32Config(**{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=16,
                                             n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                             first_k_dense_replace=1, n_shared_experts=2, q_lora_rank=16,
                                             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                             routed_scaling_factor=2.5, index_topk=4, index_n_heads=8,
                                             index_head_dim=8, pad_token_id=None, bos_token_id=0, eos_token_id=1,
                                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0,
                                                              "original_max_position_embeddings": 32, "beta_fast": 32,
                                                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}),
        "kimi_linear": tf.KimiLinearConfig(**{**COMMON, "num_hidden_layers": 5, "num_key_value_heads": 4},
                                           moe_intermediate_size=16, num_local_experts=6, num_experts_per_tok=2,
                                           n_shared_experts=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                                           qk_rope_head_dim=4, v_head_dim=12, linear_num_heads=3, linear_head_dim=6,
                                           linear_conv_kernel_dim=3, routed_scaling_factor=2.5, n_group=2,
                                           topk_group=1, pad_token_id=None, bos_token_id=0, eos_token_id=1,
                                           layer_types=["linear_attention", "full_attention", "linear_attention",
                                                        "linear_attention", "full_attention"],
                                           mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"]),
        "glm4_moe": tf.Glm4MoeConfig(**{**COMMON, "head_dim": 12}, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, rope_theta=5000.0),  # noqa: E501
        "gpt_oss": tf.GptOssConfig(**{**COMMON, "head_dim": 12, "intermediate_size": 20}, num_local_experts=5, num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=0.5, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 5000.0}),  # noqa: E501
        "deepseek_v3_no_qlora": tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=16,
                                                    n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                                    topk_group=1, first_k_dense_replace=0, n_shared_experts=1,
                                                    q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                                                    qk_rope_head_dim=4, v_head_dim=8, rope_interleave=False),
    }


def random_hf_model(config, seed: int = 0, std: float = 0.08):
    """A transformers model with every weight and buffer randomised (router biases included)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else std * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model


def check_save_load_round_trip(model, out) -> None:
    """`save_pretrained` then `load_pretrained` gives back the same config and the same logits."""
    from tessera.hf import load_pretrained, save_pretrained

    save_pretrained(model, out)
    back = load_pretrained(out, dtype=torch.float32)
    assert back.cfg == model.cfg
    ids = torch.arange(20).view(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits)


def check_greedy_eager_and_served(hf, model, path) -> None:
    """Greedy tokens of three prompts equal transformers': the eager reference (the first prompt) and
    the paged engine over the saved directory `path` (blocks of 4, chunks of 6: prompts cut across)."""
    from tessera.infer import LLM, SamplingParams
    from tessera.infer.engine.reference_generation import reference_generate
    from tests.infer.tiny_models import hf_greedy

    prompts = [[3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8], [17, 4], [60, 61, 62, 63, 1, 2, 3]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(hf, p, 10) for p in prompts]
    assert reference_generate(model, prompts[0], params) == want[0]
    llm = LLM(path, block_size=4, max_num_batched_tokens=6)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
