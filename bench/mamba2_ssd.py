"""Prompt processing of Mamba-2's SSD on CPU: the chunked form against the recurrent one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/mamba2_ssd.py

One Nemotron-H-8B Mamba-2 layer's core (`--heads` heads of dim `--head-dim`, `--groups` groups of
state size `--state`, fp32, one sequence of `--tokens` tokens; tessera/models/linear_attention/ssd.py):
`chunked_ssd` (chunks of `--chunk`) and `recurrent_ssd` (token by token) on the same random inputs,
the two alternated `--rounds` times, each side's median kept; tokens/s of each, their ratio (issue
50's target: chunked >= 5x recurrent at 8k tokens) and the largest difference between their outputs.
Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    from tessera.models.linear_attention.ssd import chunked_ssd, recurrent_ssd

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    S, H, P, G, N = args.tokens, args.heads, args.head_dim, args.groups, args.state
    x = torch.randn(1, S, H, P, generator=gen)
    dt = torch.rand(1, S, H, generator=gen) * 0.1 + 0.001
    A = -torch.rand(H, generator=gen) * 4 - 0.5
    B, C = (torch.randn(1, S, G, N, generator=gen) for _ in range(2))
    D = torch.randn(H, generator=gen)
    times: dict[str, list[float]] = {"chunked": [], "recurrent": []}
    outputs = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name in times:
                start = time.perf_counter()
                if name == "chunked":
                    outputs[name] = chunked_ssd(x, dt, A, B, C, D, chunk=args.chunk)[0]
                else:
                    outputs[name] = recurrent_ssd(x, dt, A, B, C, D)[0]
                times[name].append(time.perf_counter() - start)
    tps = {name: S / statistics.median(t) for name, t in times.items()}
    print(json.dumps({"tokens": S, "heads": H, "head_dim": P, "groups": G, "state": N, "chunk": args.chunk,
                      "threads": args.threads, "tokens_per_s": {n: round(v, 1) for n, v in tps.items()},
                      "chunked_over_recurrent": round(tps["chunked"] / tps["recurrent"], 2),
                      "max_abs_diff": float((outputs["chunked"] - outputs["recurrent"]).abs().max())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
