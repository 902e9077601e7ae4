"""Quantized routed experts: perplexity on held-out text and resident weight memory of a small MoE
trained on the bundled corpus, for every path that keeps its experts quantized.

    python bench/quantized_moe.py [--steps 200] [--tokens 4096] [--out DIR]

The model is configs/tiny-moe.yaml (Mixtral family: 8 experts, top 2) narrowed to dim 128, 2
layers, 4 heads (2 KV), expert ffn 256, trained `--steps` steps on the bundled corpus (stdlib
source, the bundled tokenizer), then exported as a HuggingFace directory and served by the engine
(fp32) from each of:
- the full-precision directory, and quantized at load (`--quantization int8|fp8|int4`);
- pre-quantized directories, written from the export as the formats store them, every block linear
  layer and every routed expert's projections quantized, the routers not: DeepSeek-V3 block FP8
  (128 x 128 blocks, `weight_scale_inv`), and compressed-tensors by the compressed-tensors library
  (tests/checkpoint/quantized_moe_checkpoints.py: W4A16 and W8A16 in groups of 128, FP8 per channel
  with dynamic per-token activations; weight scales by min / max);
- `tessera quantize` directories (rtn W4A16 groups of 128, rtn W8A16 per channel, fp8).
Perplexity is bench/quantization.py's (held-out stdlib source after the corpus's cut, its first
`--tokens` tokens, through the serving path). Memory is counted from the served model's tensors:
the routed experts' (codes and scales; for the full-precision model their fp32 weights), the other
block linear layers', and every tensor of the model. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quantization import held_out_text, nbytes, train_and_export  # noqa: E402
from tessera.infer import EngineConfig, LLMEngine  # noqa: E402
from tessera.infer.engine.perplexity import perplexity  # noqa: E402
from tessera.quantize import QuantizeOptions, quantize  # noqa: E402

CONFIG = str(ROOT / "configs" / "tiny-moe.yaml")
MODEL = ("model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=384",
         "model.moe.ffn_dim=256")
AT_LOAD = (None, "int8", "fp8", "int4")
PREQUANTIZED = ("block_fp8", "w4a16", "w8a16", "fp8_channel_dynamic")
STATIC = {"rtn W4A16 g128": ("rtn", QuantizeOptions()), "rtn W8A16 per channel": ("rtn", QuantizeOptions(
    bits=8, group_size=0)), "fp8 dynamic": ("fp8", QuantizeOptions())}


def prequantized_dir(source: Path, kind: str, out: Path) -> Path:
    from tests.checkpoint.quantized_moe_checkpoints import block_fp8_directory, compress_directory

    dst = out / kind
    shutil.copytree(source, dst)
    if kind == "block_fp8":
        block_fp8_directory(dst, (128, 128))
    else:
        compress_directory(dst, kind, group_size=128)
    return dst


def measure(path: Path, method: str | None, token_ids: list[int]) -> dict:
    engine = LLMEngine.from_dir(path, EngineConfig(quantization=method, block_size=16, num_blocks=64))
    model = engine.model
    start = time.perf_counter()
    ppl = perplexity(engine, token_ids, chunk=128)
    wall = time.perf_counter() - start
    experts = [m for n, m in model.named_modules() if n.endswith(".moe.experts")]
    other = [m for n, m in model.named_modules() if n.startswith("layers.") and ".moe.experts" not in n
             and hasattr(m, "in_features") and next(m.children(), None) is None]  # linear layers, any format
    return {"perplexity": ppl, "eval_wall_s": wall, "experts": type(experts[0]).__name__,
            "expert_bytes": nbytes(t for m in experts for t in m.state_dict().values()),
            "other_block_linear_bytes": nbytes(t for m in other for t in m.state_dict().values()),
            "all_weight_bytes": nbytes(model.state_dict().values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored")
    ap.add_argument("--out", default=None, help="where the run and directories go (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        last, train_s, source = train_and_export(CONFIG, MODEL, out, args.steps)
        probe = LLMEngine.from_dir(source, EngineConfig(block_size=16, num_blocks=64))
        token_ids = probe.tokenizer.encode(held_out_text(args.tokens * 8))[:args.tokens]
        del probe
        results = {f"at load {m}": measure(source, m, token_ids) for m in AT_LOAD}
        for kind in PREQUANTIZED:
            results[f"pre-quantized {kind}"] = measure(prequantized_dir(source, kind, out), None, token_ids)
        for name, (method, options) in STATIC.items():
            dst = out / name.replace(" ", "-")
            quantize(source, dst, method, options)
            results[f"tessera quantize {name}"] = measure(dst, None, token_ids)
    base = results["at load None"]
    for r in results.values():
        r["perplexity_change"] = r["perplexity"] / base["perplexity"] - 1
        r["expert_bytes_ratio"] = r["expert_bytes"] / base["expert_bytes"]
    print(json.dumps({"machine": platform.machine(), "train": {"steps": args.steps, "loss_last": last["loss"],
                                                               "wall_s": train_s},
                      "held_out_tokens": len(token_ids), "methods": results, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
