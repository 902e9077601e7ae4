"""The block products' AVX-512 (VNNI) loops against their AVX2 ones (#53), alternating in one process: a batch-1
decode step's 30 dense GGUF layer ops (gguf_dense_layer, as bench/gguf_layer_phases.py captures them from a real
greedy generation), their block products alone (the q/k/v, o, gate/up and down products of the 30 layers), one
call for the stack, and the output head (`gguf_linear_wide`: SmolLM2's Q8_0 embedding tied, 49,152 x 576).

    PYTHONPATH=$PWD .venv/bin/python bench/gguf_avx512.py [--gguf FILE] [--threads 1] [--repeats 20]

Each repeat times every measure once per path (`torch.ops.tessera_cpu.block_isa`: "avx2", then "avx512", the
order reversed every other repeat), checking that both paths give the same bits. Timed at one thread with the
thread's CPU clock (no time descheduled on a loaded machine), at more with wall time. Reported: per path the
median over repeats in us, the AVX-512 / AVX2 ratio of the medians and the median of the per-repeat ratios, the
load average before and after. One JSON object. Needs a CPU with AVX-512 F, BW, VL and VNNI.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PATHS = ("avx2", "avx512")


def measures(steps: list[dict], llm) -> dict:
    """name -> a call computing that measure once (returning what it computed, for the bits check)."""
    import torch
    from gguf_layer_phases import PRODUCTS, op_args, phases

    ops, model = torch.ops.tessera_cpu, llm.engine.model
    stack, head = model.fused_stack, model.output
    per_layer = [op_args(s) for s in steps]
    s0 = steps[0]
    x_head = steps[-1]["x"].reshape(1, -1).clone()

    def products():
        t: dict[str, float] = {}
        for s in steps:
            phases(s, t)
        return sum(t[k] for k in PRODUCTS)  # (timed inside: us)

    return {
        "layer_ops": lambda: [ops.gguf_dense_layer(*a) for a in per_layer][-1],
        "stack": lambda: ops.gguf_dense_stack(
            s0["x"], [n.weight for s in steps for n in s["layer"].norms], stack.eps,
            [m.blocks for s in steps for m in s["layer"].layers], stack.kinds, stack.sizes, stack.qkv_bias, s0["cos"],
            s0["sin"], stack.head_dim, [c for s in steps for c in s["store"]], s0["slots"], s0["rows"], s0["blocks"],
            s0["block_size"], stack.scales, stack.windows),
        "head": lambda: ops.gguf_linear_wide(x_head, head.blocks, head.kind, head.out_features, head.bias),
        "products": products,
    }


def main() -> None:
    import gguf_layer_phases
    import torch

    args, path, llm = gguf_layer_phases.setup(__doc__.splitlines()[0])
    clock = gguf_layer_phases.CLOCK[0]
    isa = torch.ops.tessera_cpu.block_isa
    assert isa("avx512") == "avx512", "this CPU has no AVX-512 F/BW/VL/VNNI path"
    steps = gguf_layer_phases.capture(llm)
    calls = measures(steps, llm)
    load = [os.getloadavg()[0]]
    runs: dict[str, dict[str, list[float]]] = {p: {} for p in PATHS}
    for r in range(args.repeats):
        got = {}
        for path_name in PATHS if r % 2 == 0 else PATHS[::-1]:
            isa(path_name)
            for name, call in calls.items():
                t0 = clock()
                y = call()
                us = y if name == "products" else (clock() - t0) * 1e6
                runs[path_name].setdefault(name, []).append(us)
                if name != "products":
                    got.setdefault(name, []).append(y)
        assert all(torch.equal(*ys) for ys in got.values()), "the two paths' bits differ"
    isa("avx512")
    load.append(os.getloadavg()[0])
    med = {p: {k: statistics.median(v) for k, v in runs[p].items()} for p in PATHS}
    out = {"gguf": str(path), "threads": args.threads, "clock": clock.__name__, "repeats": args.repeats,
           "layers": len(steps), "us": {p: {k: round(v, 1) for k, v in med[p].items()} for p in PATHS},
           "avx512_over_avx2": {k: round(med["avx512"][k] / med["avx2"][k], 3) for k in calls},
           "median_of_ratios": {k: round(statistics.median(a / b for a, b in zip(runs["avx512"][k],
                                                                                   runs["avx2"][k])), 3)
                                for k in calls},
           "same_bits": True, "load_before_after": load}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
