"""Decode attention over an int8 KV cache on CPU: the kernel reading int8 in place against the PyTorch
path (every row's blocks gathered and dequantized), and against the kernel over an fp32 cache.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/int8_kv_attention.py

One layer's attention of `--rows` decode rows, each over `--context` keys in shuffled blocks of 16,
SmolLM2-135M's heads (9 query heads on 3 KV heads of 64), through `RaggedContexts.attend` as the
serving step calls it; one thread; the minimum over `--repeats` of the mean of `--calls` calls in
process CPU time (`time.process_time`). "torch" is `TESSERA_CPU_ATTENTION=torch` (what an int8 cache
took before the kernel read it). One JSON object to stdout (microseconds per call, and ratios).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)

    import torch

    from tessera.config.model import ModelConfig
    from tessera.infer.cpu import attention as cpu_attention
    from tessera.infer.runner.ragged_attention import RaggedContexts
    from tessera.infer.scheduling.kv_cache import PagedKVCache

    torch.set_num_threads(1)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build"
    bs, n, length, g, h, d = 16, args.rows, args.context, 3, 9, 64
    cfg = ModelConfig(dim=h * d, n_layers=1, n_heads=h, n_kv_heads=g, vocab_size=64, ffn_dim=64,
                      max_seq_len=length, head_dim=d)
    per_row = -(-length // bs)
    out: dict[str, float] = {}
    for int8 in (False, True):
        kv = PagedKVCache(cfg, num_blocks=n * per_row + 1, block_size=bs, dtype=torch.float32, int8=int8)
        slots = torch.arange(kv.k[0].shape[0])
        kv.write(0, slots, torch.randn(len(slots), g, d), torch.randn(len(slots), g, d))
        blocks = list(range(n * per_row))
        random.Random(0).shuffle(blocks)
        contexts = RaggedContexts(bs)
        for r in range(n):
            contexts.add(r, 1, length, blocks[r * per_row:(r + 1) * per_row])
        contexts.freeze(torch.device("cpu"))
        q, o = torch.randn(n, h, d), torch.empty(n, h, d)
        for path in ("kernel", "torch"):
            if path == "torch":
                os.environ[cpu_attention.ENV] = "torch"
            else:
                os.environ.pop(cpu_attention.ENV, None)
            for _ in range(5):
                contexts.attend(kv, 0, q, o, 1 / math.sqrt(d), None)
            best = float("inf")
            for _ in range(args.repeats):
                t = time.process_time()
                for _ in range(args.calls):
                    contexts.attend(kv, 0, q, o, 1 / math.sqrt(d), None)
                best = min(best, (time.process_time() - t) / args.calls)
            out[f"{'int8' if int8 else 'fp32'} {path}"] = round(best * 1e6, 1)
    out["int8 kernel / int8 torch"] = round(out["int8 kernel"] / out["int8 torch"], 3)
    out["int8 kernel / fp32 kernel"] = round(out["int8 kernel"] / out["fp32 kernel"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
