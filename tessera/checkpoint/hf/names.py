"""Tensor names between Tessera and HuggingFace directories, and what an export refuses, asked of
each model's family (tessera/config/families).

`hf_names(cfg)` maps every Tessera state-dict key to the HuggingFace key(s) that hold it. Routed
experts are one [E, out, in] tensor in Tessera and E separate tensors in HuggingFace checkpoints,
so their entry lists E keys, stacked on load and split on save. `hf_fused_rows(cfg)` names the
Tessera tensors stored as rows of one fused HuggingFace tensor (Phi-3's qkv_proj, gate_up_proj): each
such key maps to the fused tensor, read at its rows and written by joining its parts in model order.
"""

from __future__ import annotations

import torch

from tessera.config.errors import ModelError
from tessera.config.families import REGISTRY
from tessera.config.families.base import TensorPart
from tessera.config.model import ModelConfig

# HuggingFace tensors no Tessera tensor comes from (recomputed buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def unread(cfg: ModelConfig, key: str) -> bool:
    """Whether HuggingFace tensor `key` is stored but never read: a recomputed buffer, or what the
    family's transformers class skips too (GLM-4.5's and Qwen3-Next's multi-token-prediction layers)."""
    return key.endswith(IGNORED_SUFFIXES) or REGISTRY[cfg.family].unread_tensor(cfg, key)


def hf_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Tessera key -> HuggingFace key(s), in model order."""
    return REGISTRY[cfg.family].tensor_names(cfg)


def hf_names_in(cfg: ModelConfig, stored: set[str]) -> dict[str, list[str]]:
    """`hf_names` as a directory holding the keys `stored` spells them (a family whose files come
    in more than one spelling picks the one there: `Family.names_in_files`)."""
    return REGISTRY[cfg.family].names_in_files(cfg, hf_names(cfg), stored)


def hf_parts(cfg: ModelConfig) -> dict[str, TensorPart]:
    """Tessera key -> its part of a fused HuggingFace tensor (Llama 4's experts), where it is one."""
    return REGISTRY[cfg.family].tensor_parts(cfg)


def fused_tensor(parts: list[tuple[TensorPart, torch.Tensor]]) -> torch.Tensor:
    """The HuggingFace tensor [..., in, count * out] of its Tessera parts [..., out, in] (any order);
    of parts not `transposed`, [..., count * out, in]."""
    ordered = sorted(parts, key=lambda p: p[0].index)
    if not ordered[0][0].transposed:
        return torch.cat([t for _, t in ordered], dim=-2).contiguous()
    return torch.cat([t.transpose(-1, -2) for _, t in ordered], dim=-1).contiguous()


def hf_unpacked(cfg: ModelConfig) -> dict[str, list[str]]:
    """Tessera key -> the per-expert HuggingFace keys some directories store a packed part under
    (Family.unpacked_names)."""
    return REGISTRY[cfg.family].unpacked_names(cfg)
def hf_fused_rows(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Tessera key -> its rows [start, stop) of the fused HuggingFace tensor its name maps to."""
    return REGISTRY[cfg.family].fused_rows(cfg)


def hf_copies(cfg: ModelConfig) -> dict[str, str]:
    """HuggingFace key -> the Tessera key whose value it repeats (DeepSeek-V3's MTP layers hold
    the embedding and head again): written on export, not read on import."""
    return REGISTRY[cfg.family].tensor_copies(cfg)


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse a model whose forward pass the HuggingFace class of `cfg.family` would not reproduce:
    routed experts and latent attention where the family has them (and only there), then the
    family's own requirements."""
    family = REGISTRY[cfg.family]
    if (cfg.moe is not None) != family.moe and not family.moe_optional:
        moe_families = sorted(name for name, f in REGISTRY.items() if f.moe)
        raise ModelError(f"model.family={cfg.family!r} does not match model.moe "
                         f"({'set' if cfg.moe is not None else 'unset'}); MoE families: {moe_families}")
    if (cfg.mla is not None) != family.mla:
        mla_families = ", ".join(name for name, f in REGISTRY.items() if f.mla)
        raise ModelError(f"multi-head latent attention (model.mla) exports only as family {mla_families}")
    family.check_exportable(cfg)
    family.check_mtp_exportable(cfg)
