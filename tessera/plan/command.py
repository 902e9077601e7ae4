"""`tessera plan CONFIG --gpus N [--search] [--json]`: the planner's command line.

The CLI calls `add_arguments(parser)` to declare the options and `run(args)` to act. The config's
`model`, `train` (seq_len, micro_batch_size, global_batch_size, dtype) and `parallel` sections
describe the run; flags describe the cluster. Exit status: 0 the plan fits (or the search found a
layout), 1 it does not, 2 the input is wrong (the message says which key and what is allowed).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from tessera.config.errors import ParallelError, TesseraError
from tessera.config.model import ModelConfig
from tessera.config.parallel import ParallelConfig
from tessera.plan.activation_terms import ACTIVATION_DTYPES
from tessera.plan.cluster import Cluster, parse_bytes, parse_rate
from tessera.plan.estimate import make_plan, precisions_for_train_dtype
from tessera.plan.layout import Layout, Workload
from tessera.plan.memory import PRECISIONS
from tessera.plan.report import render_plan, render_search
from tessera.plan.search import search


@dataclass
class RunInputs:
    """What the planner reads from a run configuration."""

    model: ModelConfig
    parallel: ParallelConfig
    work: Workload
    dtype: str  # train.dtype


def load_run_inputs(path: str, overrides: list[str] | None = None) -> RunInputs:
    """The model, layout and batch of a run configuration (`tessera.config.schema.load_config`)."""
    from tessera.config.schema import load_config

    cfg = load_config(path, overrides or [])
    t = cfg.train
    return RunInputs(model=cfg.model, parallel=cfg.parallel,
                     work=Workload(t.seq_len, t.micro_batch_size, t.global_batch_size), dtype=t.dtype)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run configuration YAML (model, train and parallel sections)")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs (the world size)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB, 141GB")
    parser.add_argument("--gpu-flops", default="989e12",
                        help="peak dense FLOP/s per GPU in the compute dtype (989e12: H100 SXM bf16)")
    parser.add_argument("--efficiency", type=float, default=0.5,
                        help="share of peak FLOP/s the matrix work reaches")
    parser.add_argument("--intra-node-bandwidth", default="450GB/s",
                        help="per-GPU collective bandwidth inside a node (450GB/s: NVLink 4)")
    parser.add_argument("--inter-node-bandwidth", default="50GB/s",
                        help="per-GPU collective bandwidth across nodes (50GB/s: 400 Gb/s InfiniBand)")
    parser.add_argument("--memory-bandwidth", default="3.35TB/s",
                        help="HBM bandwidth per GPU, bounds the optimizer step")
    parser.add_argument("--reserved-memory", default="3GiB",
                        help="memory per GPU taken by the CUDA context, NCCL and fragmentation")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default=None,
                        help="bytes of the model states (None: from train.dtype, fp32 -> fp32, bf16 -> bf16)")
    parser.add_argument("--activation-dtype", choices=sorted(ACTIVATION_DTYPES), default=None,
                        help="how activations are stored (None: from train.dtype, bf16 -> autocast-bf16)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set parallel.tp=8 (repeatable)")
    parser.add_argument("--search", action="store_true", help="rank every valid layout instead of the configured one")
    parser.add_argument("--top", type=int, default=5, help="layouts shown by --search")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    return Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                   gpu_memory=parse_bytes(args.gpu_memory, "--gpu-memory"),
                   gpu_flops=parse_rate(args.gpu_flops, "--gpu-flops", "FLOP/s"),
                   intra_node_bandwidth=parse_rate(args.intra_node_bandwidth, "--intra-node-bandwidth", "B/s"),
                   inter_node_bandwidth=parse_rate(args.inter_node_bandwidth, "--inter-node-bandwidth", "B/s"),
                   efficiency=args.efficiency,
                   reserved_bytes=parse_bytes(args.reserved_memory, "--reserved-memory"),
                   memory_bandwidth=parse_rate(args.memory_bandwidth, "--memory-bandwidth", "B/s"))


def run(args: argparse.Namespace) -> int:
    try:
        inputs = load_run_inputs(args.config, args.overrides)
        cluster = cluster_from_args(args)
        precision, act_dtype = precisions_for_train_dtype(inputs.dtype)
        precision = args.precision or precision
        act_dtype = args.activation_dtype or act_dtype
        if args.search:
            result = search(inputs.model, inputs.work, cluster, precision=precision, activation_dtype=act_dtype)
            if args.json:
                print(json.dumps({"valid": result.valid, "fitting": len(result.ranked),
                                  "ranked": [p.as_dict() | {"reason": why} for p, why in
                                             zip(result.ranked[:args.top], result.reasons(args.top))],
                                  "smallest_not_fitting": [p.as_dict() for p in result.too_big]}, indent=2))
            else:
                print(render_search(result, args.top))
                if result.ranked:
                    print("\nBest layout in detail\n")
                    print(render_plan(result.ranked[0]))
            return 0 if result.ranked else 1
        layout = Layout.from_parallel(inputs.parallel, args.gpus)
        m = inputs.work.global_batch // (inputs.work.micro_batch * layout.dp)
        if inputs.parallel.microbatches not in (None, m):
            raise ParallelError(f"parallel.microbatches={inputs.parallel.microbatches} disagrees with the batch: "
                                f"global_batch / (micro_batch x dp) = {m}")
        plan = make_plan(inputs.model, layout, inputs.work, cluster, precision=precision, activation_dtype=act_dtype)
        print(json.dumps(plan.as_dict(), indent=2) if args.json else render_plan(plan))
        return 0 if plan.fits else 1
    except TesseraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m tessera.plan.command`), the same as `tessera plan`."""
    parser = argparse.ArgumentParser(prog="tessera plan", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
