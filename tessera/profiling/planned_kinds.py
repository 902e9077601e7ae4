"""The planner's compute by kind (tessera/plan/op_time.py) beside the measured one (`tessera train
--profile`'s module hooks): per step and rank, averaged over the pipeline stages as the measurement
is averaged over ranks.

    attention   the q, k, v and output projections (forward, input and weight gradients: x 3) and the
                attention core (forward and its backward: x 1 + 2.5 fused, x 3 unfused); under cp the
                recurrent mixers' state handoff's products (op_time.py `handoff_time`)
    mlp         the MLP's, or the router's and experts' (and shared expert's), products, x 3
    loss        the LM head's product and the loss's softmax on the last stage, x 3

The planner folds the norms into one elementwise term with the residual adds, RoPE and the SwiGLU
product, so it predicts no `norm` (nor `other`) apart; recomputation is left out (the profiled
modules' recomputed forwards count where they run). The rates are the calibrated cluster's
(planned.py), so these add up to at most the plan's compute, which equals the measured compute."""

from __future__ import annotations

import dataclasses

from tessera.plan.cluster import Cluster
from tessera.plan.layout import Layout, Workload
from tessera.plan.op_time import FUSED_ATTENTION_BACKWARD, handoff_time, head_time, layer_ops
from tessera.plan.profile import ModelProfile

_MLP_OPS = ("MLP", "router", "experts", "shared expert")


def _layer_kinds(cfg, moe: bool, lay: Layout, tokens: float, seq_len: int, cluster: Cluster, dtype: str
                 ) -> tuple[float, float]:
    """(attention, mlp) seconds of one layer's forward and backward on one micro-batch."""
    attention = mlp = 0.0
    passes = 1 + (FUSED_ATTENTION_BACKWARD if lay.fused_attention else 2)
    for op in layer_ops(cfg, moe, lay, tokens, seq_len, cluster, dtype):
        if op.kind == "attention":
            attention += passes * op.seconds
        elif "projection" in op.name:
            attention += 3 * op.seconds
        elif op.name.startswith(_MLP_OPS):
            mlp += 3 * op.seconds
    return attention, mlp


def planned_kinds(cfg, lay: Layout, work: Workload, cluster: Cluster, dtype: str) -> dict[str, float]:
    """{"attention", "mlp", "loss"}: seconds per step on one rank, the mean over pipeline stages."""
    tokens = work.micro_batch * work.seq_len / lay.cp
    profile = ModelProfile.of(cfg, work.seq_len)
    per_layer = {moe: _layer_kinds(cfg, moe, lay, tokens, work.seq_len, cluster, dtype) for moe in set(profile.moe)}
    attention = mlp = 0.0
    unrecomputed = dataclasses.replace(lay, recompute="none")
    for stage in range(lay.pp):
        for (moe, _), n in profile.stage_kinds(lay.pp, lay.vpp, stage, "none", 1).items():
            attention += n * per_layer[moe][0]
            mlp += n * per_layer[moe][1]
        attention += handoff_time(cfg, unrecomputed, work, stage, cluster, profile)
    m = lay.microbatches(work)
    loss = 3 * head_time(cfg, lay, tokens, cluster)  # the last stage's only
    return {"attention": m * attention / lay.pp, "mlp": m * mlp / lay.pp, "loss": m * loss / lay.pp}
