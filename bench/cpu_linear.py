"""A served model's projections on CPU: the panel kernel against oneDNN's linear, over the same weights.

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 .venv/bin/python bench/cpu_linear.py

The shapes (in -> out) of the 110M-parameter LLaMA of bench/serve_vs_vllm.py: its fused q/k/v
(768 -> 1280), the attention output (768 -> 768), the fused gate/up (768 -> 6144), the down
projection (3072 -> 768) and the output head (768 -> 4096), at `--rows` rows (a decode step's few,
a prompt chunk's many). Each side multiplies by as many copies of the weight as fill `--bytes` (so
the weights come from memory, as in a model's step, not from the cache), alternated `--repeats`
times; the minimum per product, and the largest difference between the two results.
`--shapes IN:OUT ...` replaces the shapes. Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = ["768:1280", "768:768", "768:6144", "3072:768", "768:4096"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 256])
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--bytes", type=float, default=4e8, help="weight bytes per side and shape (default 400 MB)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from tessera.infer.cpu import attention as cpu_attention

    torch.set_num_threads(args.threads)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build"
    ops, gen = torch.ops.tessera_cpu, torch.Generator().manual_seed(0)
    cases = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split(":"))
        weights = [torch.randn(n, k, generator=gen) * k**-0.5 for _ in range(max(2, int(args.bytes // (4 * k * n))))]
        sides = {"panel": ([ops.pack_panels(w) for w in weights], lambda x, w, n=n: ops.panel_linear(x, w, None, n)),
                 "onednn": ([torch.ops.mkldnn._reorder_linear_weight(w) for w in weights],
                            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            want = F.linear(x, weights[0])
            best = {side: float("inf") for side in sides}
            diff = max((mul(x, packed[0]) - want).abs().max().item() for packed, mul in sides.values())
            for _ in range(args.repeats):
                for side, (packed, mul) in sides.items():
                    t0 = time.perf_counter()
                    for w in packed:
                        mul(x, w)
                    best[side] = min(best[side], (time.perf_counter() - t0) / len(packed))
            cases.append({"in": k, "out": n, "rows": m, "panel_us": round(best["panel"] * 1e6, 1),
                          "onednn_us": round(best["onednn"] * 1e6, 1),
                          "onednn_over_panel": round(best["onednn"] / best["panel"], 2),
                          "max_abs_diff_vs_f_linear": diff})
    print(json.dumps({"threads": args.threads, "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
