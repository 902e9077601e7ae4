"""`train.indexer_loss`: train DeepSeek-V3.2's lightning indexer with its KL objective (the DeepSeek-V3.2
report, section 2.1; tessera/models/attention_variants/indexer_loss.py).

    tessera train configs/tiny-dense.yaml --set model.preset=tiny-deepseek-v32 \
        --set train.indexer_loss.weight=1 --set train.indexer_loss.stage=dense

The indexer learns the main attention's distribution over keys (summed over heads, L1-normalised) by
KL. `stage=dense` is the warm-up: the layers attend to every key, the KL covers all of them, and every
weight but the indexers' is frozen (no gradient, no optimizer state). `stage=sparse` trains the whole
model: the layers attend to the keys the indexer picks, the KL covers those only, and the language-model
loss trains the rest while the indexer learns from the KL alone (its inputs are detached). The objective
adds `weight` x each sparse-attention layer's mean KL per query, per micro-batch, as it adds the MoE
balancing losses (logged as aux/layer{i}/indexer_kl).

Trains in one process and under dp_replicate / dp_shard, tp (the target sums every rank's heads), sp, ep and
cp (each rank's queries over the all-gathered keys of the sequence, its share of the mean) and pp (each
stage's layers add theirs to the stage's auxiliary loss).
Refused by name: a model without the indexer (model.mla.index_topk unset),
another objective than lm, an EAGLE target, LoRA adapters (they freeze the indexer's weights too), a negative
or non-finite weight, and a warm-up whose model would move its experts' selection bias
(model.moe.bias_update_rate must be 0 there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tessera.config.errors import require

INDEXER_STAGES = ("dense", "sparse")


@dataclass
class IndexerLossConfig:
    """The indexer's KL objective (module docstring). Off by default."""

    weight: float = 0.0  # >= 0: the KL term's weight; 0 = off (the indexer stays frozen, as loaded)
    stage: str = "sparse"  # dense: the warm-up (dense attention, all else frozen); sparse: over the chosen keys

    @property
    def enabled(self) -> bool:
        return self.weight > 0


def validate_indexer_loss(cfg: Any) -> None:
    """train.indexer_loss's values, the model it needs and the runs it trains in."""
    il, t = cfg.train.indexer_loss, cfg.train
    require(math.isfinite(il.weight) and il.weight >= 0, "train.indexer_loss.weight", il.weight,
            "a finite number >= 0 (0 = off)")
    require(il.stage in INDEXER_STAGES, "train.indexer_loss.stage", il.stage,
            f"one of {', '.join(INDEXER_STAGES)} (dense: the warm-up; sparse: over the chosen keys)")
    if not il.enabled:
        return
    m = cfg.model.mla
    require(m is not None and m.index_topk is not None, "train.indexer_loss.weight", il.weight,
            f"0 for model.family={cfg.model.family}: the loss trains DeepSeek-V3.2's lightning indexer, which this "
            "model has not (model.mla.index_topk unset)")
    require(t.objective == "lm", "train.objective", t.objective, "lm with train.indexer_loss")
    require(t.eagle.target is None, "train.eagle.target", t.eagle.target,
            "null with train.indexer_loss (an EAGLE run trains a draft head)")
    require(not t.lora.enabled, "train.lora.rank", t.lora.rank,
            "null with train.indexer_loss (adapters freeze the indexer's weights)")
    moe = cfg.model.moe
    if il.stage == "dense" and moe is not None and moe.expert_bias:
        require(moe.bias_update_rate == 0, "model.moe.bias_update_rate", moe.bias_update_rate,
                "0 with train.indexer_loss.stage=dense (the warm-up freezes every weight but the indexers', "
                "the experts' selection bias too)")
