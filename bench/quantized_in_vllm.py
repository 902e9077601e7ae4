"""Does vLLM load what `tessera quantize` writes, and does it generate what Tessera does from it?

    PYTHONPATH=$PWD .venv/bin/python bench/quantized_in_vllm.py --vllm-python /work/vllm-venv/bin/python \\
        [--source HF_DIR] [--methods smoothquant,fp8,rtn] [--out quantized_in_vllm.json]

vLLM is not a dependency of Tessera (bench/serve_vs_vllm.py says how to install its CPU build);
without a python that imports it (`--vllm-python` or TESSERA_VLLM_PYTHON) the script says so and
exits 0 having checked nothing.

The source is `--source` (a HuggingFace LLaMA directory) or, without one, bench/quantization.py's
small LLaMA (dim 128, 2 layers, the bundled tokenizer) trained `--steps` steps on the bundled
corpus and exported, so that its next-token distributions are peaked and greedy decoding is not a
coin toss between near-equal logits. Each method of `--methods` quantizes it once into a
compressed-tensors directory (`tessera quantize`: smoothquant = W8A8 int8, dynamic per-token
activations; fp8 = FP8 per channel, dynamic per-token activations; rtn = W4A16, groups of 128;
rtn8 = W8A16 per channel); then each directory is served by Tessera (`tessera serve`) and by vLLM's
OpenAI server, one after the other, in `--dtype`, and both are asked the same `--prompts` greedy
completions of `--max-tokens` tokens (prompts: windows of standard-library source). Reported per
method: whether vLLM came up (else the end of its log: what it refused), how many completions are
identical, and for the others the first differing character. Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve_vs_vllm import INSTALL, ServerProcess, corpus_ids, tessera_server, vllm_version  # noqa: E402
from bench.stream_client import free_port  # noqa: E402

METHODS = {"smoothquant": ("smoothquant", {}), "fp8": ("fp8", {}), "rtn": ("rtn", {}),
           "rtn8": ("rtn", {"bits": 8, "group_size": 0})}


def build_source(path: Path, steps: int) -> None:
    """bench/quantization.py's small LLaMA trained `steps` steps, exported to `path`."""
    from bench.quantization import CONFIG, MODEL, TRAIN
    from tessera.checkpoint.convert import convert
    from tessera.config.schema import load_config
    from tessera.train.trainer import Trainer

    run_dir = path.parent / "run"
    cfg = load_config(CONFIG, [*MODEL, *TRAIN, f"run_dir={run_dir}", f"train.steps={steps}",
                               f"checkpoint.interval={steps}"])
    Trainer(cfg).train()
    convert(run_dir, path)


def vllm_server(args, model: Path, port: int, log: Path) -> ServerProcess:
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "bench", "--dtype", args.dtype, "--max-model-len",
           str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs), "--disable-uvicorn-access-log"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
    return ServerProcess("vllm", cmd, env, port, log, args.vllm_start_timeout)


def completions(server: ServerProcess, prompts: list[list[int]], max_tokens: int) -> list[str]:
    import httpx

    return [httpx.post(server.url + "/v1/completions", timeout=600, json={
        "model": "bench", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).json()[
        "choices"][0]["text"] for p in prompts]


def compare(tessera: list[str], vllm: list[str]) -> dict:
    """Identical completions, and where each other pair first differs (character offset)."""
    first = [next((i for i, (a, b) in enumerate(zip(t, v)) if a != b), min(len(t), len(v)))
             for t, v in zip(tessera, vllm, strict=True) if t != v]
    return {"prompts": len(tessera), "identical": len(tessera) - len(first), "first_difference_at": first,
            "examples": [{"tessera": t, "vllm": v} for t, v in zip(tessera, vllm) if t != v][:2]}


def check(args, name: str, model: Path, prompts: list[list[int]], logs: Path) -> dict:
    """Serve `model` by Tessera, then by vLLM; their greedy completions compared."""
    t_args = argparse.Namespace(**{**vars(args), "model": model})
    with tessera_server(t_args, free_port(), logs / f"tessera-{name}.log") as t:
        ours = completions(t, prompts, args.max_tokens)
    try:
        with vllm_server(args, model, free_port(), logs / f"vllm-{name}.log") as v:
            theirs = completions(v, prompts, args.max_tokens)
    except RuntimeError as e:  # vLLM refused the directory (or did not start): its log says why
        return {"vllm_loaded": False, "vllm_log_tail": str(e)[-1500:]}
    return {"vllm_loaded": True, **compare(ours, theirs)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=os.environ.get("TESSERA_VLLM_PYTHON"),
                   help="a python that imports vLLM (default: $TESSERA_VLLM_PYTHON)")
    p.add_argument("--source", type=Path, default=None, help="HuggingFace LLaMA directory (default: train one)")
    p.add_argument("--steps", type=int, default=200, help="training steps of the default source")
    p.add_argument("--methods", default="smoothquant,fp8,rtn", help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="GiB (vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=256, help="the default source's positions")
    p.add_argument("--vllm-start-timeout", type=float, default=1800, help="seconds; its first start compiles")
    p.add_argument("--out", type=Path, default=Path("quantized_in_vllm.json"))
    p.add_argument("--work", type=Path, default=None,
                   help="where the trained source and the quantized directories go (default: a temporary directory)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    version = vllm_version(args.vllm_python)
    if version is None:
        print(f"skipped: no python with vLLM (--vllm-python {args.vllm_python!r})\n{INSTALL}", file=sys.stderr)
        return 0
    from tessera.quantize import QuantizeOptions, quantize

    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    result = {"command": "python bench/quantized_in_vllm.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": platform.machine(), "vllm": version, "methods": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.work or Path(tmp)
        source = args.source or tmp / "source"
        if args.source is None and not (source / "config.json").is_file():
            build_source(source, args.steps)
        ids = corpus_ids(source, 4096)
        rng = random.Random(7)
        starts = [rng.randrange(0, len(ids) - 64) for _ in range(args.prompts)]
        prompts = [ids[s:s + rng.randint(16, 64)] for s in starts]
        logs = args.out.parent / (args.out.stem + "-logs")
        logs.mkdir(parents=True, exist_ok=True)
        for name in methods:
            method, options = METHODS[name]
            dst = tmp / name
            shutil.rmtree(dst, ignore_errors=True)
            summary = quantize(source, dst, method, QuantizeOptions(**options)).summary()
            result["methods"][name] = {"quantized": summary, **check(args, name, dst, prompts, logs)}
            print(name, json.dumps(result["methods"][name]), file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
