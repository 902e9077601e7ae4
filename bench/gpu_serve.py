"""Serving decode speed on a GPU: `tessera.infer.LLM` and `tessera serve` vs transformers `generate`.

    python bench/gpu_serve.py                          # on a GPU: the model below, bf16
    python bench/gpu_serve.py --tiny --device cpu      # small shapes, runs anywhere (CPU smoke test)
    python bench/gpu_serve.py --enforce-eager          # the decode step without CUDA graphs

Model: LLaMA-style dense 1.15B (dim 2048, 24 layers, 16 heads, 8 KV heads, FFN 5632, vocabulary
4096) with random weights (speed does not depend on them), saved once as a HuggingFace directory
with a tokenizer of the same vocabulary. Workload: batches of 1 and 32 prompts of `--prompt-len`
random token ids, `--new-tokens` new tokens each, greedy, end-of-sequence ignored.

Sides, one after the other in this run: `LLM.generate` in this process; the same engine behind
`tessera serve` in a subprocess, driven over HTTP by one concurrent `/v1/completions` request per
prompt; transformers `generate` on the same directory in this process. Each side runs one untimed
warm-up (CUDA-graph capture happens there), then `--repeats` timed runs; the figure is the median.
tokens/s counts generated tokens over the wall time of the whole batch (prefill included).
Prints one JSON object (and writes it to `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=4096, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, max_position_embeddings=2048)
TINY_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_model(path: Path, shape: dict, dtype: str) -> None:
    """A random LLaMA of `shape` and a word-level tokenizer covering exactly its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(DTYPES[dtype]).save_pretrained(path)
    specials = ["<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<t{i}>" for i in range(len(specials), shape["vocab_size"])])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "bos_token": "<s>", "eos_token": "</s>",
                                                            "unk_token": "<unk>"}))


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(run, device: str, repeats: int) -> float:
    """Median wall seconds of `run()` after one untimed warm-up."""
    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _figures(seconds: float, batch: int, new: int) -> dict[str, float]:
    return {"seconds_median": seconds, "tokens_per_s": batch * new / seconds}


def bench_llm(model_dir: Path, args, batches: dict[int, list[list[int]]]) -> dict[str, Any]:
    from tessera.infer import LLM, SamplingParams

    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_num_seqs=max(batches),
              max_model_len=args.prompt_len + args.new_tokens + 1, enforce_eager=args.enforce_eager)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for b, ids in batches.items():
        def run(ids=ids):
            results = llm.generate(ids, params)
            assert all(len(r.token_ids) == args.new_tokens for r in results)
        out[str(b)] = _figures(timed(run, args.device, args.repeats), b, args.new_tokens)
    decoder = llm.engine.decoder
    out["graph_replays"] = decoder.replays if decoder is not None else 0
    out["eager_bucket_runs"] = decoder.eager_runs if decoder is not None else 0
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_http(model_dir: Path, args, batches: dict[int, list[list[int]]], log: Path) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tessera.infer.command", str(model_dir), "--port", str(port), "--served-model-name",
           "bench", "--log-level", "warning", "--dtype", args.dtype, "--device", args.device,
           "--max-num-seqs", str(max(batches)), "--max-model-len", str(args.prompt_len + args.new_tokens + 1)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + args.server_start_timeout
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tessera serve did not come up: {log.read_text()[-2000:]}")
                time.sleep(0.2)

            async def one_batch(ids: list[list[int]]) -> None:
                async with httpx.AsyncClient(timeout=600) as client:
                    bodies = [{"model": "bench", "prompt": p, "max_tokens": args.new_tokens, "temperature": 0,
                               "ignore_eos": True} for p in ids]
                    replies = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
                for r in replies:
                    r.raise_for_status()
                    assert r.json()["usage"]["completion_tokens"] == args.new_tokens

            return {str(b): _figures(timed(lambda ids=ids: asyncio.run(one_batch(ids)), "cpu", args.repeats), b,
                                     args.new_tokens) for b, ids in batches.items()}
        finally:
            proc.terminate()
            proc.wait(30)


def bench_transformers(model_dir: Path, args, batches: dict[int, list[list[int]]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).to(args.device).eval()
    model.generation_config.eos_token_id = None
    out = {}
    for b, ids in batches.items():
        x = torch.tensor(ids, device=args.device)

        def run(x=x):
            with torch.no_grad():
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                                   do_sample=False, pad_token_id=0)
            assert y.shape[1] == x.shape[1] + args.new_tokens
        out[str(b)] = _figures(timed(run, args.device, args.repeats), b, args.new_tokens)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small model and workload (a CPU smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 256; tiny 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median is reported)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on the Tessera sides")
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 256)
    shape = TINY_SHAPE if args.tiny else SHAPE
    batches = {b: prompts(b, args.prompt_len, shape["vocab_size"]) for b in args.batches}
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir, shape, args.dtype)
        sides = {}
        for name, side in (("llm", lambda: bench_llm(model_dir, args, batches)),
                           ("http", lambda: bench_http(model_dir, args, batches, Path(tmp) / "server.log")),
                           ("transformers_generate", lambda: bench_transformers(model_dir, args, batches))):
            sides[name] = side()
            gc.collect()  # one side's weights and cache go before the next one loads
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    result = {"benchmark": "gpu_serve", "tiny": args.tiny, "dtype": args.dtype, "enforce_eager": args.enforce_eager,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "model": shape,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats, **sides}
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
