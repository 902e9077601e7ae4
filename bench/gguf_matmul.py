"""The GGUF block kernel's product by one row of activations (a decode step of one sequence), CPU time.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/gguf_matmul.py

`torch.ops.tessera_cpu.gguf_linear` (tessera/infer/cpu/csrc/gguf_matmul_cpu.cpp) on one thread, for
SmolLM2-135M's MLP shapes (1536 x 576 and 576 x 1536) of random Gaussian weights quantized by gguf to
each `--kinds`: the minimum over `--repeats` of the mean of `--calls` products, in process CPU time
(`time.process_time`), which a loaded machine's other processes disturb far less than wall time. Run
it in two checkouts alternately to compare two versions of the kernel. One JSON object to stdout
(microseconds per product).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=["Q4_1", "Q8_0"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)

    import gguf
    import numpy as np
    import torch

    from tessera.infer.cpu.attention import kernel
    from tessera.infer.cpu.gguf_matmul import gguf_linear

    torch.set_num_threads(1)
    assert kernel() is not None, "the CPU kernels did not build"
    rng, out = np.random.default_rng(0), {}
    for kind in args.kinds:
        for n, k in ((1536, 576), (576, 1536)):
            raw = torch.from_numpy(gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32),
                                                        gguf.GGMLQuantizationType[kind]))
            x = torch.randn(1, k)
            for _ in range(20):
                gguf_linear(x, raw, kind, n)
            best = float("inf")
            for _ in range(args.repeats):
                t = time.process_time()
                for _ in range(args.calls):
                    gguf_linear(x, raw, kind, n)
                best = min(best, (time.process_time() - t) / args.calls)
            out[f"{kind} {n}x{k}"] = round(best * 1e6, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
