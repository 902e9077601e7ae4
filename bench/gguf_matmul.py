"""The GGUF block kernel's product by one row of activations (a decode step of one sequence), CPU time.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/gguf_matmul.py

`torch.ops.tessera_cpu.gguf_linear` (tessera/infer/cpu/csrc/gguf_matmul_cpu.cpp) on one thread, for
SmolLM2-135M's MLP shapes (1536 x 576 and 576 x 1536) of random Gaussian weights quantized by gguf to
each `--kinds`: the minimum over `--repeats` of the mean of `--calls` products, in process CPU time
(`time.process_time`), which a loaded machine's other processes disturb far less than wall time. Run
it in two checkouts alternately to compare two versions of the kernel. One JSON object to stdout
(microseconds per product).

`--smollm2`: instead, every product of a SmolLM2-135M Q4_1 decode step, one row of x: q and o
(576 x 576), k and v (192 x 576), gate and up (1536 x 576) in Q4_1, down (576 x 1536) in Q4_1, and the
tied head (49152 x 576) in Q8_0 as the file stores it; each with its weight bytes read per second of
CPU time (GB/s), and the step's sum (30 layers and the head) in ms and GB/s. `--threads`: intra-op
threads (the CPU time then counts every thread).

`--shapes`: the K-quants (`--kinds`, e.g. Q4_K Q6_K) at N x K (outputs x inputs) 512 x 512, 2048 x 512,
512 x 2048 and 4096 x 4096 (random valid blocks, as the tests write them), by 1 and by 8 rows of x: CPU
time per product, GB/s of weight bytes, and the fp32 product of the same shape (`F.linear`, oneDNN) as
the peer measured in the same run (kernel / fp32 time).

`--codes`: Tessera's int8 and int4 layers (quantized at load from Gaussian weights) at SmolLM2's MLP shapes,
by 1 and 8 rows: the product by the codes where they lie (`quant_matmul.quant_product`, what serves) and
by the same weights repacked into I8 / I4 blocks (the checks quant_product made before, then `gguf_linear`:
what served before; the tests' oracle),
alternating in one process, CPU time per product and the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


SMOLLM2 = {"q, o": ("Q4_1", 576, 576, 2), "k, v": ("Q4_1", 192, 576, 2), "gate, up": ("Q4_1", 1536, 576, 2),
           "down": ("Q4_1", 576, 1536, 1), "head": ("Q8_0", 49152, 576, 0)}  # kind, out, in, per layer


def smollm2_step(repeats: int, threads: int) -> dict:
    """Each SmolLM2 decode product's CPU time and GB/s of weight bytes, and the step's sum (docstring)."""
    import gguf
    import numpy as np
    import torch

    from tessera.infer.cpu.attention import kernel
    from tessera.infer.cpu.gguf_matmul import gguf_linear

    torch.set_num_threads(threads)
    assert kernel() is not None, "the CPU kernels did not build"
    rng, out, step_s, step_bytes = np.random.default_rng(0), {}, 0.0, 0
    for name, (kind, n, k, per_layer) in SMOLLM2.items():
        raw = torch.from_numpy(gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32),
                                                    gguf.GGMLQuantizationType[kind]))
        x, calls = torch.randn(1, k), max(5, int(4e7 / raw.numel()))
        for _ in range(3):
            gguf_linear(x, raw, kind, n)
        best = float("inf")
        for _ in range(repeats):
            t = time.process_time()
            for _ in range(calls):
                gguf_linear(x, raw, kind, n)
            best = min(best, (time.process_time() - t) / calls)
        out[f"{name} {kind} {n}x{k}"] = {"us": round(best * 1e6, 1), "GB/s": round(raw.numel() / best / 1e9, 2)}
        count = 30 * per_layer or 1
        step_s, step_bytes = step_s + count * best, step_bytes + count * raw.numel()
    out["step"] = {"ms": round(step_s * 1e3, 2), "GB/s": round(step_bytes / step_s / 1e9, 2)}
    return out


SHAPES = ((512, 512), (2048, 512), (512, 2048), (4096, 4096))  # N x K


def _cpu_time(fn, args: tuple, repeats: int, bytes_read: int) -> float:
    """The minimum over `repeats` of the mean CPU seconds of `fn(*args)` over enough calls to read ~40 MB."""
    calls = max(5, int(4e7 / bytes_read))
    for _ in range(3):
        fn(*args)
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.process_time() - t) / calls)
    return best


def kquant_shapes(kinds: list[str], repeats: int) -> dict:
    """Each K-quant product of SHAPES by 1 and 8 rows: us, GB/s of blocks, and us of the fp32 product."""
    import numpy as np
    import torch

    from tessera.infer.cpu.attention import kernel
    from tessera.infer.cpu.gguf_matmul import gguf_linear
    from tests.checkpoint.gguf_files import random_k_blocks

    torch.set_num_threads(1)
    assert kernel() is not None, "the CPU kernels did not build"
    rng, out = np.random.default_rng(0), {}
    for n, k in SHAPES:
        w = torch.randn(n, k)
        for rows in (1, 8):
            x = torch.randn(rows, k)
            fp32 = _cpu_time(torch.nn.functional.linear, (x, w), repeats, w.numel() * 4)
            for kind in kinds:
                raw = torch.from_numpy(random_k_blocks(kind, n, k, rng))
                best = _cpu_time(gguf_linear, (x, raw, kind, n), repeats, raw.numel())
                out[f"{kind} {n}x{k} rows {rows}"] = {"us": round(best * 1e6, 1),
                                                      "GB/s": round(raw.numel() / best / 1e9, 2),
                                                      "fp32 us": round(fp32 * 1e6, 1), "/ fp32": round(best / fp32, 2)}
    return out


def _blocks_product(layer, x, raw, kind: str):
    """The product as quant_matmul served it before: its checks, then the kernel on the repacked blocks."""
    import torch

    from tessera.infer.cpu.gguf_matmul import MAX_ROWS, gguf_linear

    if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
            or x.numel() > MAX_ROWS * x.shape[-1]):
        return None
    bias = layer.bias.detach() if layer.bias is not None else None
    return gguf_linear(x, raw, kind, layer.out_features, bias)


def codes_vs_blocks(repeats: int) -> dict:
    """In-place codes against repacked blocks for int8 / int4 layers (docstring)."""
    import torch

    from tessera.infer.cpu.attention import kernel
    from tessera.infer.cpu.quant_matmul import install, quant_product
    from tessera.models.int8 import Int8Linear
    from tessera.models.quantized import Int4Linear
    from tests.infer.test_quant_matmul import repacked

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)  # the kernel serves inference only
    assert kernel() is not None, "the CPU kernels did not build"
    out = {}
    for cls in (Int8Linear, Int4Linear):
        for n, k in ((1536, 576), (576, 1536)):
            layer = cls.from_linear(torch.nn.Linear(k, n, bias=False))
            install(layer)
            kind, raw = repacked(layer)
            for rows in (1, 8):
                x = torch.randn(rows, k)
                times = {"codes": [], "blocks": []}
                for _ in range(repeats):  # alternating
                    times["codes"].append(_cpu_time(quant_product, (layer, x), 1, raw.numel()))
                    times["blocks"].append(_cpu_time(_blocks_product, (layer, x, raw, kind), 1, raw.numel()))
                c, b = min(times["codes"]), min(times["blocks"])
                out[f"{cls.__name__} {n}x{k} rows {rows}"] = {
                    "codes us": round(c * 1e6, 1), "blocks us": round(b * 1e6, 1), "codes / blocks": round(c / b, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=["Q4_1", "Q8_0"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M's decode products (docstring)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", action="store_true", help="the K-quants at four shapes by 1 and 8 rows (docstring)")
    p.add_argument("--codes", action="store_true", help="int8 / int4 codes in place vs repacked blocks (docstring)")
    args = p.parse_args(argv)
    if args.codes:
        print(json.dumps(codes_vs_blocks(args.repeats)))
        return 0
    if args.shapes:
        print(json.dumps(kquant_shapes(args.kinds, args.repeats)))
        return 0
    if args.smollm2:
        print(json.dumps(smollm2_step(args.repeats, args.threads)))
        return 0

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
