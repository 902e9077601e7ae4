"""`--target-params N`: the sizes that bring a model to at most N parameters, by a fixed search.

Starting from the sizes given explicitly (the source's elsewhere), the search shrinks the sizes
that were not given, one step at a time, in this order, and stops at the first model of at most N
parameters (counted from its config: tessera/models/counting.py, the count of the written tensors):

1. the dense FFN hidden size, in steps of 1/16 of the source's, down to 1/2 of it;
2. the routed experts of each MoE layer, one at a time, down to half (never below top_k);
3. the layers, one at a time (the least important first), down to one;
4. the dense FFN hidden size again, down to 1/16 of the source's;
5. the routed experts again, down to top_k.

Width goes first because Minitron (Muralidharan et al. 2024, arXiv 2407.14679) found width pruning
keeps more of a model's accuracy than depth pruning at the same size. Attention heads
are pruned only when asked (--num-heads / --num-kv-heads), and so is the hidden size (--hidden-size):
embedding channels change every tensor and every RMSNorm's statistics at once, so the search
leaves that choice, and its step, to the user, and searches the other sizes around a given one.
Which layers a step drops is the measured importance's choice (selection.py), so the count of a
candidate is exact for MoE models whose dense and MoE layers differ in size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.models.counting import count_params
from tessera.prune.importance import Importance
from tessera.prune.selection import PruneSizes, pruned_config, select


def pruned_params(cfg: ModelConfig, sizes: PruneSizes, found: Importance) -> int:
    """Parameters of the model `sizes` (resolved, checked) and the measured importance would give."""
    return count_params(pruned_config(cfg, sizes, select(cfg, sizes, found).layers))


def _steps(cfg: ModelConfig, start: PruneSizes, given: PruneSizes) -> Iterator[PruneSizes]:
    """Every candidate, in the module docstring's order, each one step smaller than the one before."""
    sizes = start
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    ffn_free = given.ffn_dim is None and dense
    experts_free = given.num_experts is None and cfg.moe is not None and cfg.moe.n_groups == 1

    def ffn_down_to(sixteenths: int) -> Iterator[PruneSizes]:
        nonlocal sizes
        for j in range(1, 17 - sixteenths):
            width = max(1, cfg.ffn_dim * (16 - j) // 16)
            if ffn_free and width < sizes.ffn_dim:
                sizes = dataclasses.replace(sizes, ffn_dim=width)
                yield sizes

    def experts_down_to(fewest: int) -> Iterator[PruneSizes]:
        nonlocal sizes
        while experts_free and sizes.num_experts > max(fewest, cfg.moe.top_k):
            sizes = dataclasses.replace(sizes, num_experts=sizes.num_experts - 1)
            yield sizes

    yield from ffn_down_to(8)
    if cfg.moe is not None:
        yield from experts_down_to(math.ceil(cfg.moe.num_experts / 2))
    while given.layers is None and sizes.layers > 1:
        sizes = dataclasses.replace(sizes, layers=sizes.layers - 1)
        yield sizes
    yield from ffn_down_to(1)
    if cfg.moe is not None:
        yield from experts_down_to(cfg.moe.top_k)


def search_sizes(cfg: ModelConfig, target: int, given: PruneSizes, found: Importance) -> PruneSizes:
    """The first candidate (module docstring) of at most `target` parameters; ConfigError naming the
    smallest count the search reaches when none is."""
    sizes = given.resolved(cfg)
    count = pruned_params(cfg, sizes, found)
    for candidate in _steps(cfg, sizes, given):
        if count <= target:
            break
        sizes, count = candidate, pruned_params(cfg, candidate, found)
    if count > target:
        raise ConfigError(f"prune --target-params {target:,} is invalid: the smallest model the search reaches "
                          f"has {count:,} parameters (its sizes: {sizes}); give a larger target or smaller "
                          "explicit sizes (--layers, --ffn-hidden-size, --num-heads, --num-kv-heads, --experts, "
                          "--hidden-size)")
    return sizes
