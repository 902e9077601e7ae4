"""What each prunable part of a model contributes, measured on calibration sequences.

One forward pass per batch of calibration sequences, with hooks, gathers (Minitron's activation-
based importance, Muralidharan et al. 2024, arXiv 2407.14679; the layer measure is ShortGPT's block
influence, Men et al. 2024, arXiv 2403.03853):

- a layer's importance: the mean over tokens of the cosine distance `1 - cos(x, f(x))` between the
  hidden state entering the block and the one leaving it. A block that leaves its input as it was
  (an identity) scores 0 and is the first dropped;
- an FFN channel's (dense SwiGLU layers): the mean over tokens of |silu(w1 x) * w3 x| at that channel,
  the input of the down projection `w2`; a channel that is always 0 scores 0;
- a query head's: the mean over tokens of the L2 norm of its slice of the attention output (the
  input of `wo`), and a KV group's the sum over the query heads that read it;
- a routed expert's: how many routing slots (token, choice) the router gave it, over all tokens;
- an embedding (hidden) channel's: the mean over tokens of |RMSNorm output| at that channel, summed
  over every norm of the residual stream (each block's attention_norm and ffn_norm, or its norms
  after attention and MLP, and the final norm), Minitron's embedding-channel measure.

The sequences are cut from documents (the bundled corpus, the Python standard library's source, by
default; `tessera.data.corpus`) tokenized with the model's tokenizer and joined by its end-of-text
token. Sums are fp32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.models.transformer import Transformer


@dataclass
class Importance:
    """The measured importance of each prunable part (higher: more important), by layer index."""

    layers: dict[int, float] = field(default_factory=dict)  # mean cosine distance of the block's in and out
    ffn_channels: dict[int, torch.Tensor] = field(default_factory=dict)  # dense layer -> [ffn_dim]
    heads: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n_heads]
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [num_experts]
    hidden: torch.Tensor | None = None  # [dim]: mean |norm output| per channel, summed over the norms
    tokens: int = 0  # calibration tokens seen

    def kv_groups(self, layer: int, n_kv_heads: int) -> torch.Tensor:
        """A KV group's importance: the sum over the query heads that read it ([n_kv_heads])."""
        return self.heads[layer].view(n_kv_heads, -1).sum(dim=1)


def _cosine_distance_sum(x_BSD: torch.Tensor, y_BSD: torch.Tensor) -> float:
    cos = torch.nn.functional.cosine_similarity(x_BSD.float(), y_BSD.float(), dim=-1, eps=1e-12)  # [B, S]
    return float((1.0 - cos).sum())


@torch.no_grad()
def measure_importance(model: Transformer, tokens_NS: torch.Tensor, batch_size: int = 4) -> Importance:
    """Run `model` (eval mode) over the calibration `tokens_NS` and return what each part contributed."""
    model.eval()
    cfg, found = model.cfg, Importance()
    sums: dict[tuple[str, int], torch.Tensor | float] = {}  # (what, layer) -> sum over tokens
    handles = []

    def add(key: tuple[str, int], value) -> None:
        sums[key] = sums[key] + value if key in sums else value

    def add_norm_output(m, args, out) -> None:
        add(("hidden", -1), out.float().abs().sum(dim=(0, 1)))

    handles.append(model.norm.register_forward_hook(add_norm_output))
    for key, block in model.layers.items():
        i = int(key)
        handles += [norm.register_forward_hook(add_norm_output) for norm in (
            block.attention_norm, block.ffn_norm, block.attention_post_norm, block.ffn_post_norm) if norm is not None]
        handles.append(block.register_forward_hook(
            lambda m, args, out, i=i: add(("layers", i), _cosine_distance_sum(args[0], out[0]))))
        if cfg.mla is None:
            handles.append(block.attention.wo.register_forward_pre_hook(
                lambda m, args, i=i: add(("heads", i), args[0].float().unflatten(-1, (cfg.n_heads, cfg.head_dim))
                                         .norm(dim=-1).sum(dim=(0, 1)))))
        if hasattr(block, "feed_forward"):
            handles.append(block.feed_forward.w2.register_forward_pre_hook(
                lambda m, args, i=i: add(("ffn_channels", i), args[0].float().abs().sum(dim=(0, 1)))))
    try:
        for start in range(0, tokens_NS.shape[0], batch_size):
            out = model(tokens_NS[start:start + batch_size])
            for i, counts in out.expert_counts.items():
                add(("expert_counts", i), counts.detach().to(torch.float64).cpu())
    finally:
        for h in handles:
            h.remove()
    found.tokens = tokens_NS.numel()
    for (kind, i), value in sums.items():  # counts stay counts; the rest become means over tokens
        mean = value if kind == "expert_counts" else value / found.tokens
        mean = mean.cpu() if isinstance(mean, torch.Tensor) else mean
        if kind == "hidden":
            found.hidden = mean
        else:
            getattr(found, kind)[i] = mean
    return found
