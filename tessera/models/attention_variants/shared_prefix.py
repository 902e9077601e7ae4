"""Shared-prefix attention: several sequences that begin with the same prefix, packed in one row as
"prefix, continuation 1, ..., continuation G", where each continuation attends to the prefix and to
itself only, at the positions it would have alone (its first token right after the prefix). The
prefix is computed once, so its gradient is the sum over the continuations, exactly what G separate
rows "prefix + continuation j" give. GRPO's update packs a prompt's group of completions this way
(tessera.train.modes.grpo_packing).

    mask = SharedPrefixMask(segments, positions)   # [B, S] each: 0 prefix, j continuation j, -1 padding
    out = model(ModelInput(tokens=ids, positions=positions, cache=mask, logit_positions=index))

It is passed where a serving cache is (`ModelInput.cache`, the per-call attention seam of
`Attention.forward`): its `attend` keeps nothing and attends with the block mask, so the decoder
runs unchanged. With `attention_dtype` (float64) it attends as `wide_causal_attention` does: in
that dtype, rounded back. It serves softmax attention (with its sliding windows, chunks and sinks) and
multi-head latent attention; what attends otherwise or mixes tokens across the row is refused by
name (`shared_prefix_refusal`): linear-attention (recurrent) layers, sparse latent attention,
multimodal RoPE and capacity-limited MoE (whose dropped tokens depend on which tokens share the batch).
"""

from __future__ import annotations

import torch

from tessera.config.model import ModelConfig
from tessera.models.attention import Window, masked_attention, window_allows

PREFIX, PADDING = 0, -1  # the segment ids of the shared prefix and of padding (continuations: 1, 2, ...)


class SharedPrefixMask:
    """An `AttentionCache` (attention.py) that stores nothing: query i sees key j where j <= i in the
    row and j is in i's segment or the prefix, inside i's window measured in `positions`. Padding
    sees the prefix and itself (never empty, so its softmax stays finite), and nothing sees padding."""

    def __init__(self, segments: torch.Tensor, positions: torch.Tensor, attention_dtype: torch.dtype | None = None):
        """`attention_dtype` (float64: GRPO's fp64_attention): attend in it and round back to the queries'
        dtype, as `wide_causal_attention` does for whole rows (a layer with sinks keeps its fp32 softmax)."""
        self.segments, self.positions, self.attention_dtype = segments, positions, attention_dtype
        self._masks: dict[Window, torch.Tensor] = {}

    def mask(self, window: Window) -> torch.Tensor:
        """Boolean [B, 1, S, S], True where a query may see a key (class docstring); one per window."""
        if window not in self._masks:
            seg, pos = self.segments, self.positions
            S = seg.shape[1]
            order = torch.arange(S, device=seg.device)
            causal = order[:, None] >= order[None, :]
            same = (seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == PREFIX)
            allowed = causal & same & ((seg[:, None, :] != PADDING) | (seg[:, :, None] == PADDING))
            if window is not None:
                allowed &= window_allows(pos[:, :, None], pos[:, None, :], window)
            self._masks[window] = allowed[:, None]
        return self._masks[window]

    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: Window, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return masked_attention(q_BHSD, k_BGSD, v_BGSD, self.mask(window), scale, q_BHSD.shape[1] != k_BGSD.shape[1],
                                sinks, self.attention_dtype)


def shared_prefix_refusal(cfg: ModelConfig, mrope_section: list[int] | None = None) -> str | None:
    """Why a model of `cfg` (`mrope_section`: its multimodal RoPE's, `Transformer.mrope_section`) cannot
    run shared-prefix rows, or None where it can (module docstring)."""
    if not all(cfg.has_attention(i) for i in range(cfg.n_layers)):
        return "its linear-attention or Mamba layers carry a recurrent state through the row, not a per-key mask"
    if cfg.mla is not None and cfg.mla.index_topk is not None:
        return "sparse latent attention (mla.index_topk) picks its keys through its own cache call, not a mask"
    if mrope_section is not None:
        return "multimodal RoPE places tokens by (t, h, w), not by one position"
    if cfg.is_moe and cfg.moe.capacity_factor is not None:
        return (f"model.moe.capacity_factor={cfg.moe.capacity_factor:g} drops tokens by what shares the batch, "
                "so the packed rows would drop other tokens than per-completion rows")
    return None
