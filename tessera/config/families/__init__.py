"""The model families Tessera loads from and exports to HuggingFace, registered in one place.

Each family is one module of this package (base.py: what a family is); `REGISTRY` maps its name
(config.json's model_type, `ModelConfig.family`) to it. `ModelConfig` checks its `family` here,
`tessera.config.hf_config` reads and writes config.json through it, `tessera.config.presets`
collects the families' presets, and `tessera.checkpoint.hf.names` asks it for tensor names and
export checks. Adding a family: a module here, its line below, and its case in the parity tests
(tests/models/hf_families.py).
"""

from tessera.config.families import (
    deepseek_v3,
    deepseek_v32,
    exaone4,
    gemma3_text,
    glm4_moe,
    gpt_oss,
    llama,
    llama4_text,
    mistral,
    mixtral,
    olmo2,
    olmo3,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    seed_oss,
    smollm3,
)
from tessera.config.families.base import Family
from tessera.config.families.hybrid import kimi_linear, nemotron_h, qwen3_5, qwen3_5_moe, qwen3_next

REGISTRY: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    smollm3.FAMILY,
    olmo2.FAMILY,
    olmo3.FAMILY,
    seed_oss.FAMILY,
    exaone4.FAMILY,
    phi3.FAMILY,
    gemma3_text.FAMILY,
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5_moe.FAMILY,
    nemotron_h.FAMILY,
    deepseek_v3.FAMILY,
    deepseek_v32.FAMILY,
    kimi_linear.FAMILY,
    llama4_text.FAMILY,
    glm4_moe.FAMILY,
    gpt_oss.FAMILY,
)}

__all__ = ["REGISTRY", "Family"]
