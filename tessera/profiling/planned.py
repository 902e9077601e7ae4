"""The planner's prediction of each term of a profiled run's step (tessera/plan), for the run's own
model, layout and batch (run_dir/config.yaml), side by side with the measurement.

The hardware is the plan's preset GPU (`gpu`, H100 by default) with its compute rates (FLOP/s,
memory and host bandwidth) scaled so that the planned compute equals the measured one: on a CPU, or
any device the presets do not describe, the planner then predicts the other terms (the pipeline
bubble, the optimizer step) relative to the speed the run really computed at. The links stay the
preset's: exposed communication is predicted for that interconnect, not for the CPU's loopback.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tessera.config.schema import load_config
from tessera.plan.cluster import Cluster
from tessera.plan.estimate import make_plan, precisions_for_train_dtype
from tessera.plan.layout import Layout, Workload
from tessera.profiling.planned_kinds import planned_kinds

_CALIBRATION_ROUNDS = 3  # compute time is close to linear in the rates: a few rescalings settle it


def _plan(cfg, world: int, cluster: Cluster):
    layout = Layout.from_parallel(cfg.parallel, world)
    t = cfg.train
    precision, act_dtype = precisions_for_train_dtype(t.dtype)
    return make_plan(cfg.model, layout, _workload(cfg), cluster, precision=precision, activation_dtype=act_dtype)


def _workload(cfg) -> Workload:
    t = cfg.train
    return Workload(t.seq_len, t.micro_batch_size, t.global_batch_size)


def _scaled(cluster: Cluster, k: float) -> Cluster:
    return dataclasses.replace(cluster, gpu_flops=cluster.gpu_flops * k, memory_bandwidth=cluster.memory_bandwidth * k,
                               host_bandwidth=cluster.host_bandwidth * k)


def planned_terms(run_dir: Path, world: int, measured_compute_s: float, gpu: str = "h100") -> dict[str, Any]:
    """{"terms": {term: seconds per step}, "hardware": what the plan assumed, "total_s"}; raises a
    TesseraError when the run's config cannot be planned."""
    cfg = load_config(str(Path(run_dir) / "config.yaml"), [])
    cluster = Cluster.for_gpu(gpu, gpus=world, gpus_per_node=world)
    plan = _plan(cfg, world, cluster)
    for _ in range(_CALIBRATION_ROUNDS):
        if measured_compute_s <= 0 or plan.time.compute <= 0:
            break
        cluster = _scaled(cluster, plan.time.compute / measured_compute_s)
        plan = _plan(cfg, world, cluster)
    time = plan.time.as_dict()
    terms: dict[str, float] = {"compute": time["compute"], "pipeline_bubble": time["bubble"],
                               "optimizer": time["optimizer"], "data_wait": 0.0, "checkpoint": 0.0, "idle": 0.0}
    for group, seconds in time["exposed_per_step"].items():
        name = f"exposed_comm/{group.removesuffix(' (once per step)')}"
        terms[name] = terms.get(name, 0.0) + seconds
    hardware = (f"{gpu} links, compute rates scaled to the measured compute "
                f"({cluster.gpu_flops / 1e9:.3g} GFLOP/s peak, efficiency {cluster.efficiency:.2f})")
    kinds = planned_kinds(cfg.model, plan.layout, _workload(cfg), cluster, plan.activation_dtype)
    return {"terms": terms, "hardware": hardware, "total_s": plan.time.total,
            "compute_by_kind": {**kinds, "optimizer": time["optimizer"]},
            "model_flops_per_step": plan.model_flops_per_step}
