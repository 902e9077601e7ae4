"""Static quantization (`tessera quantize`): perplexity on held-out text and weight bytes on disk of
a small model trained on the bundled corpus, for every method, read back by transformers.

    python bench/quantize_static.py [--steps 300] [--tokens 4096] [--out DIR]

The model and its training are bench/quantization.py's (tiny-dense widened to dim 128, 2 layers,
ffn 384; `--steps` steps on the bundled corpus), exported as a HuggingFace directory (fp32), then
quantized by each method into a compressed-tensors directory (GPTQ and SmoothQuant calibrated on
the bundled corpus: 16 sequences of 256 tokens, the default). Each directory is loaded by
`transformers.AutoModelForCausalLM` (compressed-tensors decompresses it; W8A8 and FP8 also
quantize every linear layer's input per token, as the format says) and scored on the same
held-out tokens as bench/quantization.py: standard-library source after the corpus's cut, in
windows of 128 tokens. Bytes: the directory's safetensors files, and the quantized linear layers'
tensors alone. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quantization import CONFIG, MODEL, held_out_text, train_and_export  # noqa: E402
from tessera.data.tokenizer import load_tokenizer  # noqa: E402
from tessera.quantize import QuantizeOptions, quantize  # noqa: E402

WINDOW = 128
# name -> (method, options)
RUNS = {
    "rtn W4A16 g128": ("rtn", QuantizeOptions()),
    "gptq W4A16 g128": ("gptq", QuantizeOptions()),
    "gptq W4A16 g128 actorder": ("gptq", QuantizeOptions(actorder=True)),
    "rtn W8A16 per channel": ("rtn", QuantizeOptions(bits=8, group_size=0)),
    "gptq W8A16 per channel": ("gptq", QuantizeOptions(bits=8, group_size=0)),
    "smoothquant W8A8": ("smoothquant", QuantizeOptions()),
    "fp8 dynamic": ("fp8", QuantizeOptions()),
}
QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


@torch.no_grad()
def perplexity(path: Path, token_ids: list[int]) -> float:
    """exp(mean next-token loss) over non-overlapping windows of WINDOW tokens, by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, WINDOW):
        ids = torch.tensor([token_ids[start:start + WINDOW + 1]])
        if ids.shape[1] < 2:
            break
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
        total, count = total + float(loss), count + ids.shape[1] - 1
    return math.exp(total / count)


def weight_bytes(path: Path, layers: set[str] | None) -> tuple[int, int]:
    """Bytes of every tensor in the directory's safetensors, and of the quantized layers' alone."""
    from safetensors import safe_open

    every = linear = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                t = st.get_tensor(key)
                size = t.numel() * t.element_size()
                every += size
                quantized = key.endswith(QUANTIZED_SUFFIXES) or (key.endswith(".weight") and t.dtype in (
                    torch.int8, torch.float8_e4m3fn))
                in_layers = layers is not None and key.removesuffix(".weight") in layers
                linear += size if quantized or in_layers else 0
    return every, linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored")
    ap.add_argument("--out", default=None, help="where the run and directories go (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        last, train_s, source = train_and_export(CONFIG, MODEL, out, args.steps)
        token_ids = load_tokenizer(str(source)).encode(held_out_text(args.tokens * 8))[:args.tokens]
        results: dict[str, dict] = {}
        for name, (method, options) in RUNS.items():
            dst = out / name.replace(" ", "-")
            start = time.perf_counter()
            result = quantize(source, dst, method, options)
            wall = time.perf_counter() - start
            every, linear = weight_bytes(dst, None)
            results[name] = {"perplexity": perplexity(dst, token_ids), "quantize_wall_s": wall,
                             "weight_bytes": every, "quantized_layer_bytes": linear, "format": result.scheme.format}
        linear_names = _linear_names(source)
        every, linear = weight_bytes(source, linear_names)
        base = {"perplexity": perplexity(source, token_ids), "weight_bytes": every, "quantized_layer_bytes": linear}
    for r in results.values():
        r["perplexity_change"] = r["perplexity"] / base["perplexity"] - 1
        r["quantized_layer_bytes_ratio"] = r["quantized_layer_bytes"] / base["quantized_layer_bytes"]
    print(json.dumps({"machine": platform.machine(), "train": {"steps": args.steps, "loss_last": last["loss"],
                                                               "wall_s": train_s},
                      "held_out_tokens": len(token_ids), "unquantized": base, "methods": results,
                      "args": vars(args)}, indent=1))


def _linear_names(path: Path) -> set[str]:
    """The HuggingFace names of the block linear layers of the model in `path` (what every method quantizes)."""
    from tessera.checkpoint.hf.names import hf_names
    from tessera.config.hf_config import read_hf_config
    from tessera.models.int8 import quantizable_layers
    from tessera.models.transformer import Transformer

    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
    names = hf_names(cfg)
    return {names[f"{n}.weight"][0].removesuffix(".weight") for n, _ in quantizable_layers(model)}


if __name__ == "__main__":
    main()
