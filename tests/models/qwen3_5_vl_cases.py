"""Tiny random transformers Qwen3.5 / Qwen3.5-MoE vision-language models (Qwen3-VL's tower before a
hybrid language model): a learned position table of 4 x 4 resampled to every image's grid, six
rotary pairs dealt to (t, h, w) in turn, three Gated DeltaNet layers and one attention layer. The
images, prompts and image processor are Qwen2-VL's cases' (tests/models/qwen_vl_cases.py)."""

from __future__ import annotations

import torch

from tests.models.qwen_vl_cases import IMAGE, VIDEO, VISION_END, VISION_START

FAMILIES = ("qwen3_5", "qwen3_5_moe")
# head_dim 16 x partial 0.75 = 12 rotated dims: pairs (t, h, w) = (2, 2, 2), interleaved
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.75,
                             "mrope_section": [2, 2, 2], "mrope_interleaved": True})
MOE = dict(moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=24)
VISION = dict(depth=2, hidden_size=24, intermediate_size=40, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


def hf_qwen3_5_vl(family: str, seed: int = 0, tie: bool = False, vocab: int = 96):
    """A transformers Qwen3.5 (family "qwen3_5") or Qwen3.5-MoE ("qwen3_5_moe") with every weight
    random (the tower's norms near 1; the language model's (1 + w) norms near 0 + 1), fp32, eval mode;
    its image, vision start / end and video tokens the last four ids of its `vocab`."""
    import transformers as tf

    cls, model_cls = ((tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration) if family == "qwen3_5"
                      else (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration))
    text = {**TEXT, **(MOE if family == "qwen3_5_moe" else {}), "tie_word_embeddings": tie, "vocab_size": vocab}
    shift = vocab - 96
    cfg = cls(text_config=text, vision_config=VISION, image_token_id=IMAGE + shift,
              vision_start_token_id=VISION_START + shift, vision_end_token_id=VISION_END + shift,
              video_token_id=VIDEO + shift, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            tower_norm = "visual" in name and "norm" in name and name.endswith("weight")
            p.copy_(1 + 0.1 * noise if tower_norm else 0.08 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
