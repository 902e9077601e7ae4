"""What a pruned model keeps: its sizes, the parts chosen by importance, its config and its weights.

`PruneSizes` are the sizes asked for (None: the source's); `check_sizes` refuses sizes the model
cannot take; `select` keeps, in each place, the most important parts (importance.py), in their
source order: the `layers` most important blocks, per dense layer the `ffn_dim` most important FFN
channels, per attention layer the `n_kv_heads` most important KV groups with, in each, its
`n_heads / n_kv_heads` most important query heads (GQA stays grouped: query head j reads KV group
j // (n_heads / n_kv_heads) before and after), per MoE layer the `num_experts` most routed experts,
and the `dim` most important embedding channels of the residual stream (hidden.py).
Ties keep the earlier part. `pruned_config` is the source config with the new sizes and the dense /
MoE layers renumbered; `pruned_state` is the source's tensors at the kept indices, nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tessera.config.errors import ConfigError, require
from tessera.config.model import ModelConfig
from tessera.prune.hidden import slice_hidden
from tessera.prune.importance import Importance


@dataclass(frozen=True)
class PruneSizes:
    """Sizes of the pruned model; None keeps the source's."""

    layers: int | None = None  # decoder layers
    ffn_dim: int | None = None  # hidden size of the dense SwiGLU layers
    n_heads: int | None = None  # query heads
    n_kv_heads: int | None = None  # KV groups
    num_experts: int | None = None  # routed experts of each MoE layer
    dim: int | None = None  # hidden size: the embedding channels every layer reads and writes (hidden.py)

    def resolved(self, cfg: ModelConfig) -> PruneSizes:
        """Every size filled in: the source's where None; one head count given implies the other
        (only --num-kv-heads: whole groups leave with their query heads; only --num-heads: the groups stay)."""
        heads, groups = self.n_heads, self.n_kv_heads
        if heads is None and groups is not None:
            heads = groups * (cfg.n_heads // cfg.n_kv_heads)
        elif groups is None and heads is not None:
            groups = cfg.n_kv_heads
        return PruneSizes(layers=cfg.n_layers if self.layers is None else self.layers,
                          ffn_dim=cfg.ffn_dim if self.ffn_dim is None else self.ffn_dim,
                          n_heads=cfg.n_heads if heads is None else heads,
                          n_kv_heads=cfg.n_kv_heads if groups is None else groups,
                          num_experts=(cfg.moe.num_experts if cfg.moe else None) if self.num_experts is None
                          else self.num_experts,
                          dim=cfg.dim if self.dim is None else self.dim)


def check_sizes(cfg: ModelConfig, sizes: PruneSizes) -> None:
    """Refuse (ConfigError, naming the option and what is allowed) sizes this model cannot be pruned to.
    `sizes` are resolved (`PruneSizes.resolved`)."""
    def option(ok: bool, flag: str, value: int | None, allowed: str) -> None:
        require(ok, f"prune {flag}", value, allowed, sep=" ")  # `prune --layers 5 is invalid: ...`

    if cfg.linear_attention is not None or cfg.mamba is not None:
        raise ConfigError(f"prune: the {cfg.family} model has recurrent layers (model.linear_attention, model.mamba: "
                          "Gated DeltaNet, Kimi delta attention, Mamba-2), whose importance pruning does not measure; "
                          "prune a model without them")
    option(1 <= sizes.layers <= cfg.n_layers, "--layers", sizes.layers, f"must be in 1..{cfg.n_layers} (the source's)")
    option(1 <= sizes.dim <= cfg.dim, "--hidden-size", sizes.dim, f"must be in 1..{cfg.dim} (the source's)")
    dense = [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]
    option(1 <= sizes.ffn_dim <= cfg.ffn_dim, "--ffn-hidden-size", sizes.ffn_dim, f"must be in 1..{cfg.ffn_dim}")
    option(sizes.ffn_dim == cfg.ffn_dim or bool(dense), "--ffn-hidden-size", sizes.ffn_dim,
           f"the {cfg.family} model has no dense FFN layer (every layer is MoE); prune experts with --experts")
    if cfg.mla is not None:
        option(sizes.n_heads == cfg.n_heads and sizes.n_kv_heads == cfg.n_kv_heads, "--num-heads", sizes.n_heads,
               "multi-head latent attention heads cannot be pruned (their keys share one compressed projection)")
    group = cfg.n_heads // cfg.n_kv_heads
    option(1 <= sizes.n_kv_heads <= cfg.n_kv_heads, "--num-kv-heads", sizes.n_kv_heads,
           f"must be in 1..{cfg.n_kv_heads} (the source's KV groups)")
    option(1 <= sizes.n_heads <= cfg.n_heads and sizes.n_heads % sizes.n_kv_heads == 0, "--num-heads", sizes.n_heads,
           f"must be in 1..{cfg.n_heads} and a multiple of the {sizes.n_kv_heads} KV groups")
    option(sizes.n_heads // sizes.n_kv_heads <= group, "--num-heads", sizes.n_heads,
           f"{sizes.n_heads // sizes.n_kv_heads} query heads per KV group is more than the source's {group}; "
           f"at most {sizes.n_kv_heads * group} for {sizes.n_kv_heads} KV groups (drop KV groups with --num-kv-heads)")
    if cfg.moe is None:
        option(sizes.num_experts is None, "--experts", sizes.num_experts,
               f"the {cfg.family} model is dense: it has no experts to prune")
        return
    e = cfg.moe
    if sizes.num_experts != e.num_experts:
        option(e.n_groups == 1, "--experts", sizes.num_experts, f"the {cfg.family} model routes within "
               f"{e.n_groups} expert groups (group-limited routing); its experts cannot be pruned one by one")
    option(e.top_k <= sizes.num_experts <= e.num_experts, "--experts", sizes.num_experts,
           f"must be in {e.top_k}..{e.num_experts}: at least the {e.top_k} experts each token is routed to (top_k)")


@dataclass
class Selection:
    """The source indices a pruned model keeps, in source order, by source layer index."""

    layers: list[int]
    ffn_channels: dict[int, torch.Tensor] = field(default_factory=dict)
    q_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    kv_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_channels: torch.Tensor | None = None  # the embedding channels kept (all of them: the source's order)


def most_important(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the `k` highest `scores` (ties: the earlier index), in increasing order."""
    order = torch.argsort(-scores.to(torch.float64), stable=True)
    return order[:k].sort().values


def select(cfg: ModelConfig, sizes: PruneSizes, found: Importance) -> Selection:
    """The parts to keep (module docstring), for resolved, checked `sizes`."""
    layer_scores = torch.tensor([found.layers[i] for i in range(cfg.n_layers)])
    chosen = Selection(layers=most_important(layer_scores, sizes.layers).tolist(),
                       hidden_channels=most_important(found.hidden, sizes.dim))
    group, per_group = cfg.n_heads // cfg.n_kv_heads, sizes.n_heads // sizes.n_kv_heads
    for i in chosen.layers:
        if not cfg.is_moe_layer(i):
            chosen.ffn_channels[i] = most_important(found.ffn_channels[i], sizes.ffn_dim)
        else:
            chosen.experts[i] = most_important(found.expert_counts[i], sizes.num_experts)
        if cfg.mla is not None:
            continue
        groups = most_important(found.kv_groups(i, cfg.n_kv_heads), sizes.n_kv_heads)
        heads = [g * group + most_important(found.heads[i][g * group:(g + 1) * group], per_group) for g in groups]
        chosen.kv_heads[i], chosen.q_heads[i] = groups, torch.cat(heads)
    return chosen


def pruned_config(cfg: ModelConfig, sizes: PruneSizes, kept_layers: list[int]) -> ModelConfig:
    """The source config with the new sizes; its dense layers (and layers without RoPE) among
    `kept_layers` keep being so under their new numbers (the dense ones as a leading run, first_k_dense,
    where the source counted them so, else listed)."""
    moe = None
    if cfg.moe is not None:
        dense = [new for new, old in enumerate(kept_layers) if not cfg.is_moe_layer(old)]
        leading = dense == list(range(len(dense))) and not cfg.moe.dense_layers and cfg.moe.layer_freq == 1
        placement = (dict(first_k_dense=len(dense), dense_layers=[]) if leading
                     else dict(first_k_dense=0, dense_layers=dense, layer_freq=1))
        moe = dataclasses.replace(cfg.moe, num_experts=sizes.num_experts, **placement)
    nope = [new for new, old in enumerate(kept_layers) if old in cfg.nope_layers]  # NoPE layers stay NoPE
    return dataclasses.replace(cfg, dim=sizes.dim, n_layers=sizes.layers, ffn_dim=sizes.ffn_dim, n_heads=sizes.n_heads,
                               n_kv_heads=sizes.n_kv_heads, head_dim=cfg.head_dim, moe=moe, nope_layers=nope)


def _head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The rows of a [heads * head_dim, ...] projection that belong to `heads`."""
    return (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()


def _slice(name: str, t: torch.Tensor, old: int, chosen: Selection, head_dim: int) -> torch.Tensor:
    """Tensor `name` (its name inside block `old`) at the kept indices."""
    if name.startswith("attention.") and old in chosen.q_heads:
        q, kv = _head_rows(chosen.q_heads[old], head_dim), _head_rows(chosen.kv_heads[old], head_dim)
        if name.startswith("attention.wo."):
            return t[:, q] if name.endswith("weight") else t  # o's bias is over the model dim
        rows = {"wq": q, "wk": kv, "wv": kv}.get(name.split(".")[1])
        return t if rows is None else t[rows]  # q_norm / k_norm are over head_dim: shared by every head
    if name.startswith("feed_forward."):
        idx = chosen.ffn_channels[old]
        return t[:, idx] if name == "feed_forward.w2.weight" else t[idx]
    if name in ("moe.router.weight", "moe.router.expert_bias") or name.startswith("moe.experts."):
        return t[chosen.experts[old]]
    return t  # norms, shared experts and their gate: whole


def pruned_state(state: dict[str, torch.Tensor], cfg: ModelConfig, chosen: Selection) -> dict[str, torch.Tensor]:
    """The source's tensors (Tessera names) at the kept indices, the kept blocks renumbered 0..K-1,
    each at the kept hidden channels (hidden.py)."""
    out = {k: v for k, v in state.items() if not k.startswith("layers.")}
    for new, old in enumerate(chosen.layers):
        prefix = f"layers.{old}."
        for key, t in state.items():
            if key.startswith(prefix):
                name = key[len(prefix):]
                out[f"layers.{new}.{name}"] = _slice(name, t, old, chosen, cfg.head_dim).contiguous()
    return slice_hidden(out, chosen.hidden_channels)
