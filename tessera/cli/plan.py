"""`tessera plan CONFIG --gpus N [--search] [--json]`: the planner's command line.

The config's `model`, `train` (seq_len, micro_batch_size, global_batch_size, dtype) and
`parallel` sections describe the run (with `train.distill.teacher`, the teacher's frozen weights are
counted on every rank and only pp = 1 is planned); flags describe the cluster (`--gpu` picks a
preset). `tessera plan validate` compares the time model with published runs
(tessera/plan/published.py). Exit status: 0 the plan fits (or the search found a layout), 1 it does
not (or a file it names cannot be read), 2 the input is wrong (the message says which key and what
is allowed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from tessera.config.argument_types import int_in
from tessera.config.errors import ConfigError, ParallelError
from tessera.config.limits import MAX_PARALLEL_SIZE
from tessera.config.model import ModelConfig
from tessera.plan.activation_dtypes import ACTIVATION_DTYPES
from tessera.plan.cluster import Cluster, parse_bytes, parse_rate
from tessera.plan.efficiency import DEFAULT_PROFILE, PROFILES
from tessera.plan.estimate import make_plan, precisions_for_train_dtype
from tessera.plan.gpus import GPUS
from tessera.plan.layout import Layout
from tessera.plan.memory import PRECISIONS
from tessera.plan.report import render_plan, render_search
from tessera.plan.run_inputs import load_run_inputs
from tessera.plan.search import MAX_SEARCH_LAYOUTS, SearchResult, search

MAX_SEARCH_CAP = 1_000_000  # --max-layouts: a million plans is hours; more is not a bound


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run configuration YAML (model, train and parallel sections), or "
                                       "`validate` to compare the time model with published training runs")
    parser.add_argument("--gpus", type=int_in(1, MAX_PARALLEL_SIZE), default=None,
                        help="number of GPUs (the world size)")
    parser.add_argument("--gpus-per-node", type=int_in(1, MAX_PARALLEL_SIZE), default=8, help="GPUs per node")
    parser.add_argument("--gpu", default="h100", type=str.lower, choices=sorted(GPUS),
                        help="GPU preset: peak FLOP/s, memory, HBM, NVLink and network bandwidth and the "
                             "time model's efficiencies (tessera/plan/gpus.py)")
    parser.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GiB, 141GB (None: the preset's)")
    parser.add_argument("--gpu-flops", default=None,
                        help="peak dense FLOP/s per GPU in the compute dtype (None: the preset's bf16 peak)")
    parser.add_argument("--efficiency", type=efficiency_choice, default=None,
                        help="the kernels' efficiency profile: megatron (Megatron-class kernels, fitted to published "
                             "runs; the default), tessera (this project's own, unfitted until GPU measurements "
                             "exist), torch-eager (torch's kernels without torch.compile, unfitted), or a number: "
                             "the share of peak a large matrix product sustains, on megatron's")
    parser.add_argument("--intra-node-bandwidth", default=None,
                        help="per-GPU collective (bus) bandwidth inside a node (None: the preset's NVLink x 0.8)")
    parser.add_argument("--inter-node-bandwidth", default=None,
                        help="per-GPU collective (bus) bandwidth across nodes (None: the preset's network x 0.9)")
    parser.add_argument("--memory-bandwidth", default=None,
                        help="HBM bandwidth per GPU: elementwise work and the optimizer (None: the preset's)")
    parser.add_argument("--tp-overlap", action="store_true",
                        help="assume TP/SP collectives overlap the layer's GEMMs (off: on the critical path)")
    parser.add_argument("--ep-overlap", action="store_true",
                        help="assume a DualPipe-style / 1F1B all-to-all overlap schedule hides the EP all-to-all "
                             "(on by itself for parallel.pp_schedule=dualpipev with parallel.pp_overlap)")
    parser.add_argument("--reserved-memory", default="3GiB",
                        help="memory per GPU taken by the CUDA context, NCCL and fragmentation")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default=None,
                        help="bytes of the model states (None: from train.dtype, fp32 -> fp32, bf16 -> bf16)")
    parser.add_argument("--activation-dtype", choices=sorted(ACTIVATION_DTYPES), default=None,
                        help="how activations are stored (None: from train.dtype, bf16 -> autocast-bf16)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set parallel.tp=8 (repeatable)")
    parser.add_argument("--host-bandwidth", default=None,
                        help="per-GPU bandwidth to host memory, per direction: activation offload (None: the preset's)")
    parser.add_argument("--search", action="store_true", help="rank every valid layout instead of the configured one")
    parser.add_argument("--max-layouts", type=int_in(1, MAX_SEARCH_CAP), default=MAX_SEARCH_LAYOUTS,
                        help="--search plans at most this many candidate layouts; a larger space is sampled "
                             "uniformly (fixed seed) and the output says so")
    parser.add_argument("--top", type=int, default=5, help="layouts shown by --search")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def efficiency_choice(text: str) -> str | float:
    """`--efficiency`: a profile name (efficiency.py) or a share of peak in (0, 1]."""
    if text.lower() in PROFILES:
        return text.lower()
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: one of {', '.join(PROFILES)}, or a number in (0, 1]"
                                         ) from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: a share of peak must be in (0, 1]")
    return value


def cluster_from_args(args: argparse.Namespace, compute_dtype: str = "bf16") -> Cluster:
    """The `--gpu` preset (its peak for `compute_dtype`: `train.dtype` bf16 runs matrix products in
    bf16, fp32 in fp32) under the `--efficiency` profile, with any explicitly given flag replacing
    its value."""
    def given(value: object, parse) -> float | None:
        return None if value is None else parse(value)

    profile = args.efficiency if isinstance(args.efficiency, str) else DEFAULT_PROFILE
    share = args.efficiency if isinstance(args.efficiency, float) else None
    return Cluster.for_gpu(
        args.gpu, gpus=args.gpus, gpus_per_node=args.gpus_per_node, dtype=compute_dtype, profile=profile,
        host_bandwidth=given(args.host_bandwidth, lambda v: parse_rate(v, "--host-bandwidth", "B/s")),
        gpu_memory=given(args.gpu_memory, lambda v: parse_bytes(v, "--gpu-memory")),
        gpu_flops=given(args.gpu_flops, lambda v: parse_rate(v, "--gpu-flops", "FLOP/s")),
        intra_node_bandwidth=given(args.intra_node_bandwidth,
                                   lambda v: parse_rate(v, "--intra-node-bandwidth", "B/s")),
        inter_node_bandwidth=given(args.inter_node_bandwidth,
                                   lambda v: parse_rate(v, "--inter-node-bandwidth", "B/s")),
        efficiency=share,
        reserved_bytes=parse_bytes(args.reserved_memory, "--reserved-memory"),
        memory_bandwidth=given(args.memory_bandwidth, lambda v: parse_rate(v, "--memory-bandwidth", "B/s")))


def search_json(result: SearchResult, top: int) -> dict:
    """The search as JSON: `best` (the winner's plan, its `parallel` mapping for `tessera train --set
    parallel.K=V`, and why it wins), then the ranked top layouts."""
    reasons = result.reasons(top)
    out: dict = {"valid": result.valid, "fitting": len(result.ranked), "best": None,
                 "candidates": result.candidates, "sampled": result.sampled, "coverage": result.coverage(),
                 "ranked": [p.as_dict() | {"parallel": p.layout.parallel_settings(), "reason": why}
                            for p, why in zip(result.ranked[:top], reasons)],
                 "smallest_not_fitting": [p.as_dict() for p in result.too_big]}
    if result.ranked:
        out["best"] = out["ranked"][0] | {"against_other_shapes": result.alternatives()}
    return out


def teacher_model(path: str | None) -> ModelConfig | None:
    """train.distill.teacher's model shape (its config.json or checkpoint), read only when one is set."""
    if path is None:
        return None
    from tessera.train.objectives.teacher import teacher_model_config

    return teacher_model_config(path)


def run(args: argparse.Namespace) -> int:
    if args.config == "validate":
        from tessera.plan.validate import run_validation

        return run_validation(args.json)
    if args.gpus is None:
        raise ConfigError("--gpus is required: the number of GPUs (the world size)")
    inputs = load_run_inputs(args.config, args.overrides)
    teacher = teacher_model(inputs.teacher)
    cluster = cluster_from_args(args, "fp32" if inputs.dtype == "fp32" else "bf16")
    precision, act_dtype = precisions_for_train_dtype(inputs.dtype)
    precision = args.precision or precision
    act_dtype = args.activation_dtype or act_dtype
    overlaps = {"tp_overlap": args.tp_overlap, "ep_overlap": args.ep_overlap}
    if args.search:
        result = search(inputs.model, inputs.work, cluster, precision=precision, activation_dtype=act_dtype,
                        overlaps=overlaps, max_layouts=args.max_layouts, teacher=teacher)
        if args.json:
            print(json.dumps(search_json(result, args.top), indent=2))
        else:
            print(render_search(result, args.top))
            if result.ranked:
                print("\nBest layout in detail\n")
                print(render_plan(result.ranked[0]))
        return 0 if result.ranked else 1
    layout = Layout.from_parallel(inputs.parallel, args.gpus)  # the trainer's overlapped DualPipeV: ep_overlap
    layout = dataclasses.replace(layout, **{k: v for k, v in overlaps.items() if v})
    m = inputs.work.global_batch // (inputs.work.micro_batch * layout.dp)
    if inputs.parallel.microbatches not in (None, m):
        raise ParallelError(f"parallel.microbatches={inputs.parallel.microbatches} disagrees with the batch: "
                            f"global_batch / (micro_batch x dp) = {m}")
    plan = make_plan(inputs.model, layout, inputs.work, cluster, precision=precision, activation_dtype=act_dtype,
                     teacher=teacher)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else render_plan(plan))
    return 0 if plan.fits else 1
