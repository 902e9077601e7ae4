"""Prompt processing of the gated delta rule on CPU: the chunked form against the recurrent one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 .venv/bin/python bench/gated_deltanet.py

One Qwen3-Next-80B-A3B Gated DeltaNet layer's core (`--heads` value heads of key and value dim
`--head-dim`, fp32, one sequence of `--tokens` tokens; tessera/models/linear_attention/delta_rule.py):
`chunked_delta_rule` (chunks of `--chunk`) and `recurrent_delta_rule` (token by token) on the same
random inputs, the two alternated `--rounds` times, each side's median kept; tokens/s of each, their
ratio (issue 50's target: chunked >= 5x recurrent at 8k tokens), each round's ratio, the same (median
and each round's) from the CPU time each side's process used (`time.process_time`: what other
processes sharing the cores take is not counted in it), the load average before and after, and the
largest difference between their outputs. `--per-channel`: Kimi delta attention's decay, one per key
channel (Kimi-Linear-48B-A3B's layer: 32 heads of 128, the defaults) instead of one per head.
`--kernel`: a third side, the chunked form with each chunk's terms from the CPU library's kernel
(`delta_chunk_terms`, what the serving engine installs at the mixers' `fused_chunk_terms`;
tessera/infer/cpu/layer_ops.py), alternated with the other two and reported the same way
("chunked_kernel"; its ratios to the recurrent form and to the PyTorch chunked form).
Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-channel", action="store_true", help="a decay per key channel (Kimi delta attention)")
    p.add_argument("--kernel", action="store_true", help="also time the chunked form through the C++ kernel")
    args = p.parse_args(argv)

    import torch

    from tessera.models.linear_attention.delta_rule import chunked_delta_rule, recurrent_delta_rule

    kernel = None
    if args.kernel:
        from tessera.infer.cpu import attention as cpu_attention

        if cpu_attention.kernel() is None:
            print("the CPU library did not build (see the log)", file=sys.stderr)
            return 1
        kernel = torch.ops.tessera_cpu.delta_chunk_terms
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    S, H, D = args.tokens, args.heads, args.head_dim
    q, k, v = (torch.randn(1, S, H, D, generator=gen) for _ in range(3))
    g = -torch.rand(1, S, H, *((D,) if args.per_channel else ()), generator=gen) * 0.1
    beta = torch.rand(1, S, H, generator=gen)
    sides = ["chunked", *(["chunked_kernel"] if kernel else []), "recurrent"]
    times: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    outputs = {}
    load_before = os.getloadavg()[0]
    with torch.no_grad():
        for _ in range(args.rounds):
            for name in times:
                start, start_cpu = time.perf_counter(), time.process_time()
                if name.startswith("chunked"):
                    fused = kernel if name == "chunked_kernel" else None
                    outputs[name] = chunked_delta_rule(q, k, v, g, beta, chunk=args.chunk, chunk_terms=fused)[0]
                else:
                    outputs[name] = recurrent_delta_rule(q, k, v, g, beta)[0]
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    tps = {name: S / statistics.median(t) for name, t in times.items()}
    cpu_tps = {name: S / statistics.median(t) for name, t in cpu.items()}
    report = {"tokens": S, "heads": H, "head_dim": D, "chunk": args.chunk, "threads": args.threads,
              "decay": "per channel" if args.per_channel else "per head",
              "tokens_per_s": {n: round(x, 1) for n, x in tps.items()},
              "cpu_tokens_per_s": {n: round(x, 1) for n, x in cpu_tps.items()}}
    for name in sides[:-1]:
        suffix = "" if name == "chunked" else "_kernel"
        report[f"chunked{suffix}_over_recurrent"] = round(tps[name] / tps["recurrent"], 2)
        report[f"per_round{suffix}"] = [round(r / c, 2) for c, r in zip(times[name], times["recurrent"])]
        report[f"cpu_per_round{suffix}"] = [round(r / c, 2) for c, r in zip(cpu[name], cpu["recurrent"])]
        report[f"cpu_chunked{suffix}_over_recurrent"] = round(cpu_tps[name] / cpu_tps["recurrent"], 2)
        report[f"max_abs_diff{suffix}"] = float((outputs[name] - outputs["recurrent"]).abs().max())
    if kernel:
        report["kernel_over_pytorch_chunked"] = round(tps["chunked_kernel"] / tps["chunked"], 2)
        report["cpu_kernel_over_pytorch_chunked"] = round(cpu_tps["chunked_kernel"] / cpu_tps["chunked"], 2)
    report["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
