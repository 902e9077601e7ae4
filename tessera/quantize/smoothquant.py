"""SmoothQuant's smoothing (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models", arXiv 2211.10438, eq. 4): move the activations' outlier
channels into the weights before int8 quantization of both.

For the layers that read one normalized input x (q, k, v after the attention RMSNorm; gate and up
after the FFN RMSNorm), per input channel j:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

where max|X_j| is over the calibration tokens and max|W_j| over the rows of every layer reading x.
Then x_j / s_j and W_:j * s_j give the same product; the division is folded into the RMSNorm's
weight (g_j / s_j), so no extra operation runs and the model computes the same function (to
floating-point rounding). The output projection (its input comes from attention) and the down
projection (from the SwiGLU product) are not smoothed: nothing with a per-channel weight precedes
them that the fold would be exact for in every family. alpha 0.5 is the paper's default.
"""

from __future__ import annotations

import torch

from tessera.models.transformer import Transformer

DEFAULT_ALPHA = 0.5
MIN_SCALE = 1e-5  # a channel with no activation or weight keeps a finite, positive scale

# (RMSNorm, the linear layers that read its output), inside every block.
SMOOTHED = (("attention_norm", ("attention.wq", "attention.wk", "attention.wv")),
            ("ffn_norm", ("feed_forward.w1", "feed_forward.w3")))


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] of eq. 4 from the inputs' per-channel max |x| [in] and the weights [out, in] reading them."""
    w_absmax = torch.cat([w.detach().abs().double() for w in weights]).amax(0).clamp(min=MIN_SCALE)
    s = act_absmax.double().clamp(min=MIN_SCALE).pow(alpha) / w_absmax.pow(1.0 - alpha)
    return s.clamp(min=MIN_SCALE)


@torch.no_grad()
def smooth(model: Transformer, act_absmax: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA) -> int:
    """Fold the smoothing scales into `model` in place (norm weights divided, linear columns
    multiplied); `act_absmax` maps a linear layer's name to its inputs' max |x| per channel
    (calibration.input_absmax). Returns the number of norms smoothed."""
    count = 0
    for key, block in model.layers.items():
        for norm_name, linear_names in SMOOTHED:
            linears = [block.get_submodule(n) for n in linear_names]
            s = smoothing_scales(act_absmax[f"layers.{key}.{linear_names[0]}"], [m.weight for m in linears], alpha)
            norm = block.get_submodule(norm_name)
            offset = 1.0 if norm.unit_offset else 0.0  # Gemma's norm scales by (1 + weight)
            norm.weight.copy_(((norm.weight.double() + offset) / s - offset).to(norm.weight.dtype))
            for m in linears:
                m.weight.copy_((m.weight.double() * s[None, :]).to(m.weight.dtype))
            count += 1
    return count
