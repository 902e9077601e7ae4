"""One layer's attention of a prompt chunk on CPU: the C++ kernel over the paged cache against SDPA.

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 .venv/bin/python bench/cpu_attention.py

The kernel (`tessera/infer/cpu/csrc/paged_attention_cpu.cpp`, through `RaggedContexts.attend`) reads the
chunk's keys and values where they lie in a paged cache (blocks of 16 in shuffled order); SDPA gets
the same keys gathered beforehand (the gather not timed), with `is_causal` for a chunk from position 0
(as the serving step's PyTorch path does) and an explicit mask for a chunk after earlier context.
`--heads` query and KV heads of `--head-dim`, fp32, `--threads` threads; the minimum of `--repeats`
calls each, and the largest difference between the two outputs. Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = [(512, 0), (1024, 0), (300, 200), (128, 384)]  # (chunk tokens, position of its first token)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from tessera.infer.cpu import attention as cpu_attention
    from tessera.infer.runner.ragged_attention import RaggedContexts

    torch.set_num_threads(args.threads)
    kernel = cpu_attention.kernel()
    if kernel is None:
        raise SystemExit("the CPU attention kernel did not build (see the log)")
    H, D, bs, n_blocks = args.heads, args.head_dim, 16, 128
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(n_blocks * bs, H, D, generator=gen)
    v_cache = torch.randn(n_blocks * bs, H, D, generator=gen)
    rng = random.Random(0)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(min(times) * 1e3, 3)

    def measure(S: int, P: int) -> dict:
        L = P + S
        table = rng.sample(range(n_blocks), -(-L // bs))
        q_SHD = torch.randn(S, H, D, generator=gen)
        o_SHD = torch.empty(S, H, D)
        rows = RaggedContexts(bs)
        rows.add(0, S, L, table)
        rows.freeze(torch.device("cpu"))
        scale = 1 / math.sqrt(D)

        def run_kernel() -> None:
            kernel(q_SHD, o_SHD, k_cache, v_cache, rows.rows_R4, rows.block_index, bs, scale, 0)

        slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(L)])
        q, k, v = (t.transpose(0, 1)[None] for t in (q_SHD, k_cache[slots], v_cache[slots]))
        visible = torch.arange(L)[None, :] <= torch.arange(P, L)[:, None]
        bias = None if P == 0 else torch.zeros(S, L).masked_fill_(~visible, float("-inf"))

        def run_sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None, scale=scale)

        run_kernel()
        diff = (run_sdpa()[0].transpose(0, 1) - o_SHD).abs().max().item()
        return {"chunk": S, "position": P, "kernel_ms": best(run_kernel), "sdpa_ms": best(run_sdpa),
                "sdpa": "is_causal" if P == 0 else "mask", "max_abs_diff": diff}

    out = {"threads": args.threads, "heads": H, "head_dim": D, "cases": [measure(S, P) for S, P in CASES]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
