"""Pruning embedding channels (`--hidden-size D`): the residual stream keeps the D channels of
largest importance (importance.py: Minitron's mean |RMSNorm output| per channel, summed over every
norm of the hidden size), and every tensor that reads or writes the stream keeps those channels.

Where the hidden size sits in each tensor (Tessera names, inside a block where they start with
`layers.N.`); every other tensor of a model must be one of `NO_HIDDEN_AXIS`, so a family whose
tensors are not all known here is refused by name rather than sliced by guess:

    [V, D] / [out, D]  (input columns)   tok_embeddings, output, attention.wq / wk / wv, attention.wq_a /
                                         wkv_a (MLA), feed_forward.w1 / w3, moe.router, moe.shared_experts.w1 /
                                         w3, moe.shared_gate; moe.experts.w1 / w3 [E, F, D]; sparse
                                         attention's attention.indexer.wk / weights_proj
    [D, in] (output rows)                attention.wo, feed_forward.w2, moe.shared_experts.w2; moe.experts.w2
                                         [E, D, F]; attention.wo's bias [D]
    [D]                                  norm, attention_norm, ffn_norm (each RMSNorm of the stream)

A tied head (tie_embeddings) is the embedding itself, sliced once. The RMSNorms then average over
fewer channels, which changes the function (Minitron recovers it by distillation); keeping every
channel keeps the tensors, and the function, exactly.
"""

from __future__ import annotations

import torch

from tessera.config.errors import ConfigError

INPUT_COLUMNS = ("tok_embeddings.weight", "output.weight", "attention.wq.weight", "attention.wk.weight",
                 "attention.wv.weight", "attention.wq_a.weight", "attention.wkv_a.weight", "feed_forward.w1.weight",
                 "feed_forward.w3.weight", "moe.router.weight", "moe.shared_experts.w1.weight",
                 "moe.shared_experts.w3.weight", "moe.shared_gate.weight", "moe.experts.w1", "moe.experts.w3",
                 "attention.indexer.wk.weight", "attention.indexer.weights_proj.weight")
OUTPUT_ROWS = {"attention.wo.weight": 0, "attention.wo.bias": 0, "feed_forward.w2.weight": 0,
               "moe.shared_experts.w2.weight": 0, "moe.experts.w2": 1}
NORMS = ("norm.weight", "attention_norm.weight", "ffn_norm.weight", "attention_post_norm.weight",
         "ffn_post_norm.weight")
NO_HIDDEN_AXIS = ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias", "attention.q_norm.weight",
                  "attention.k_norm.weight", "attention.kv_norm.weight", "attention.wq_b.weight",
                  "attention.wkv_b.weight", "moe.router.expert_bias", "attention.indexer.wq_b.weight",
                  "attention.indexer.k_norm.weight", "attention.indexer.k_norm.bias")


def _name_in_block(key: str) -> str:
    """`layers.3.attention.wq.weight` -> `attention.wq.weight`; top-level names unchanged."""
    parts = key.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" else key


def hidden_axis(key: str) -> int | None:
    """The axis of tensor `key` that holds the hidden size (None: it has none); ConfigError for a
    tensor this module does not know."""
    name = _name_in_block(key)
    if name in INPUT_COLUMNS:
        return -1
    if name in OUTPUT_ROWS:
        return OUTPUT_ROWS[name]
    if name in NORMS:
        return 0
    if name in NO_HIDDEN_AXIS:
        return None
    raise ConfigError(f"prune --hidden-size is invalid for this model: its tensor {key!r} is not one whose hidden "
                      "axis is known (tessera/prune/hidden.py); prune the other sizes only")


def check_hidden_axes(shapes: dict[str, tuple[int, ...]], dim: int) -> None:
    """Every tensor's place is known and its hidden axis holds `dim` (ConfigError naming the first that is not)."""
    for key, shape in shapes.items():
        axis = hidden_axis(key)
        if axis is not None and shape[axis] != dim:
            raise ConfigError(f"prune --hidden-size is invalid for this model: its tensor {key!r} {list(shape)} has "
                              f"no axis of the hidden size {dim} where one is expected")


def slice_hidden(state: dict[str, torch.Tensor], channels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every tensor of `state` (Tessera names) at the kept hidden `channels` along its hidden axis."""
    out = {}
    for key, t in state.items():
        axis = hidden_axis(key)
        out[key] = t if axis is None else t.index_select(axis % t.dim(), channels).contiguous()
    return out
