"""`train.eagle`: train an EAGLE-3 draft head against a frozen target (the EAGLE mode of the training
loop: tessera.train.modes.eagle, tessera.models.eagle) instead of training the `model` section's model.

    tessera train configs/tiny-dense.yaml --set train.eagle.target=runs/tiny-dense

The target (a HuggingFace directory or a Tessera run / checkpoint) is read and frozen; its shape is
its own, so the config's `model` section is not used. The draft layer takes the target's width,
heads and RoPE (tessera.models.eagle.draft_layer_config). Data, batch sizes, `optim`, `train.steps`,
`train.seed`, `train.dtype`, `train.grad_clip`, `train.log_interval` and `checkpoint` (but `export_hf`)
apply as to any run (there is no evaluation: `eagle_acc/{j}` in metrics.jsonl is the measure to
watch). The draft is written to
`run_dir/<output_dir>` at the end in the EAGLE-3 directory format vLLM and SGLang load
(tessera.checkpoint.eagle_dir), which `tessera serve TARGET --speculative eagle --draft-model DIR`
serves. Data parallelism only (dp_replicate, dp_shard): the draft is held whole on every rank and
its gradients summed over the ranks; pp, tp, cp and ep are refused by name, and so are fp16 and
distillation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.config.errors import require
from tessera.config.layout_rules import need_data_parallel_only

MAX_UNROLL = 16
VOCAB_SAMPLE_BATCHES = 64  # global batches whose tokens are counted for train.eagle.draft_vocab_size


@dataclass
class EagleTrainConfig:
    """The EAGLE-3 draft head's training (Li et al. 2025): next-token prediction of the target's own
    distribution from its hidden states, over `unroll` steps of training-time test."""

    # The frozen target: a HuggingFace model directory or a Tessera checkpoint / run directory, of any
    # family; the tokenizer (data.tokenizer) must be the target's. None = an ordinary run (no EAGLE).
    target: str | None = None
    # Block counts of the target whose residual stream is fused (0: the embedding .. n_layers: the last
    # block's output, before the final norm); [] = the low, middle and high default
    # (tessera.models.eagle.default_feature_layers: vLLM's (2, L // 2, L - 3) for deep targets).
    feature_layers: list[int] = field(default_factory=list)
    # Training-time test steps: step j > 0 feeds the draft its own step j-1 outputs (1 = no unrolling;
    # EAGLE-3 unrolls several; each step costs one more pass of the draft layer and head).
    unroll: int = 3
    # Tokens the draft predicts over: None = the target's whole vocabulary; N = the N most frequent target
    # tokens of the first VOCAB_SAMPLE_BATCHES global batches of the data (EAGLE-3's reduced draft
    # vocabulary: a smaller head; the other tokens are never drafted), written as d2t / t2d.
    draft_vocab_size: int | None = None
    output_dir: str = "draft"  # where the draft directory goes, under run_dir (an absolute path replaces it)


def validate_eagle(cfg: Any) -> None:
    """train.eagle's values and the layouts and settings it trains under (the target's own shape is
    checked when it is read: tessera.train.modes.eagle)."""
    e, p = cfg.train.eagle, cfg.parallel
    require(e.target is None or bool(e.target), "train.eagle.target", e.target,
            "a HuggingFace model directory or a Tessera checkpoint / run directory (null = no EAGLE training)")
    require(1 <= e.unroll <= MAX_UNROLL, "train.eagle.unroll", e.unroll, f"must be in 1..{MAX_UNROLL}")
    require(all(int(j) >= 0 for j in e.feature_layers), "train.eagle.feature_layers", list(e.feature_layers),
            "block counts >= 0 ([] = the default low, middle and high layers)")
    require(bool(e.output_dir), "train.eagle.output_dir", e.output_dir, "a non-empty path")
    require(e.draft_vocab_size is None or e.draft_vocab_size > 0, "train.eagle.draft_vocab_size", e.draft_vocab_size,
            "null (the target's vocabulary) or a number of tokens > 0")
    if e.target is None:
        return
    need_data_parallel_only(p, "train.eagle.target", "EAGLE draft training")
    require(cfg.train.dtype != "fp16", "train.dtype", cfg.train.dtype,
            "fp32 or bf16 with train.eagle.target (the draft is trained without fp16 loss scaling)")
    require(cfg.train.distill.teacher is None, "train.distill.teacher", cfg.train.distill.teacher,
            "null with train.eagle.target (an EAGLE run trains the draft head only)")
