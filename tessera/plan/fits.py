"""The start-up memory check: will this run fit on these GPUs? Answered before anything is allocated.

    message = check_fits(cfg.model, cfg.parallel, seq_len=..., micro_batch=..., global_batch=...,
                         world=world_size, gpu_memory=torch.cuda.get_device_properties(0).total_memory)
    if message: warn(message)

It plans the configured layout and compares the busiest rank's peak with the GPU's memory less a
reserve (CUDA context, NCCL buffers, fragmentation). When it does not fit, the message gives the
peak by part and the first of a few cheap changes (more ZeRO sharding, operator-level or full
recomputation, micro-batch 1) that would make it fit.
"""

from __future__ import annotations

import dataclasses

from tessera.config.errors import TesseraError
from tessera.config.model import ModelConfig
from tessera.config.parallel import ParallelConfig
from tessera.plan.cluster import Cluster, parse_bytes
from tessera.plan.estimate import Plan, make_plan, precisions_for_train_dtype
from tessera.plan.layout import Layout, Workload

GiB = 2**30


def _cluster_for(world: int, gpu_memory: float, reserved_bytes: float) -> Cluster:
    per_node = 8 if world % 8 == 0 else world  # only the memory matters here
    return Cluster(gpus=world, gpus_per_node=per_node, gpu_memory=gpu_memory,
                   reserved_bytes=min(reserved_bytes, 0.5 * gpu_memory))


def _summary(plan: Plan) -> str:
    s = plan.peak
    return (f"{s.total / GiB:.1f} GiB on pipeline stage {s.stage} (weights {s.states.weights / GiB:.1f}, "
            f"gradients {s.states.gradients / GiB:.1f}, master {s.states.master / GiB:.1f}, optimizer "
            f"{s.states.optimizer / GiB:.1f}, gather buffers {s.states.gathered / GiB:.1f}, activations "
            f"{s.activations.stored / GiB:.1f} for {s.activations.in_flight:g} micro-batch(es) in flight, "
            f"transient {s.activations.transient / GiB:.1f})")


def check_fits(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, seq_len: int, micro_batch: int,
               global_batch: int, world: int, gpu_memory: float | str, *, dtype: str = "bf16",
               reserved_bytes: float = 3 * GiB) -> str | None:
    """None when the run fits; otherwise a message saying by how much it does not, and what would.

    `dtype` is `train.dtype` (fp32, or bf16 = autocast over fp32 weights). A layout that cannot run
    at all (a size that does not divide) is reported the same way, as a message.
    """
    try:
        memory = parse_bytes(gpu_memory, "gpu_memory")
        precision, act_dtype = precisions_for_train_dtype(dtype)
        lay = Layout.from_parallel(parallel_cfg, world)
        work = Workload(seq_len, micro_batch, global_batch)
        cluster = _cluster_for(world, memory, reserved_bytes)
        plan = make_plan(model_cfg, lay, work, cluster, precision=precision, activation_dtype=act_dtype)
    except TesseraError as e:
        return f"cannot plan this run: {e}"
    if plan.fits:
        return None
    message = (f"this run needs about {_summary(plan)} per GPU, more than the {cluster.usable_memory / GiB:.1f} GiB "
               f"usable of {memory / GiB:.1f} GiB")
    tries = [("zero_stage=3", {"zero_stage": 3}, work), ("recompute=op", {"recompute": "op"}, work),
             ("recompute=full", {"recompute": "full"}, work),
             ("zero_stage=3 and recompute=full", {"zero_stage": 3, "recompute": "full"}, work),
             ("zero_stage=3, recompute=full and micro_batch_size=1", {"zero_stage": 3, "recompute": "full"},
              dataclasses.replace(work, micro_batch=1))]
    for label, change, w in tries:
        if all(getattr(lay, k) == v for k, v in change.items()) and w == work:
            continue
        try:
            alt = make_plan(model_cfg, dataclasses.replace(lay, **change), w, cluster, precision=precision,
                            activation_dtype=act_dtype)
        except TesseraError:
            continue
        if alt.fits:
            return message + f"; with {label} it would need {alt.peak.total / GiB:.1f} GiB"
    return message + "; try more GPUs or more tensor/pipeline parallelism (`tessera plan --search`)"
