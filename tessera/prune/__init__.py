"""Structured pruning of a HuggingFace model directory (Minitron-style: Muralidharan et al. 2024,
arXiv 2407.14679): drop whole layers, FFN channels, attention heads / KV groups and routed experts,
ranked by their importance measured on calibration data, to explicit sizes or to a parameter target.

- `importance`: the measures (cosine distance of a block's input and output, mean |activation| of
  an FFN channel, mean norm of a head's output, routing counts of an expert) and the calibration data;
- `selection`: the sizes, their checks, which parts stay, the pruned config and weights;
- `target`: the search for `--target-params`;
- `run`: `prune(src, dst, ...)`, HuggingFace directory in and out (`tessera prune`).
"""

from tessera.prune.run import PruneResult, prune
from tessera.prune.selection import PruneSizes

__all__ = ["PruneResult", "PruneSizes", "prune"]
