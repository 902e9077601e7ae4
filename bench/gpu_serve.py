"""Serving decode speed on a GPU: `tessera.infer.LLM` and `tessera serve` vs transformers `generate`.

    python bench/gpu_serve.py                          # on a GPU: the model below, bf16
    python bench/gpu_serve.py --tiny --device cpu      # small shapes, runs anywhere (CPU smoke test)
    python bench/gpu_serve.py --enforce-eager          # the decode step without CUDA graphs

Without CUDA it refuses to start unless `--tiny` is given.

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

`--load-test` measures the server alone under load instead: `--clients` concurrent streaming
clients (64 by default) send `--requests` completions of mixed prompt lengths (a quarter to twice
`--prompt-len`), half of them behind one shared prefix of `--prompt-len` tokens (prefix-cache hits)
and half unique; it reports generated tokens/s over the whole run and the percentiles (p50, p90,
p99) of time to first token (TTFT) and time per output token after the first (TPOT).
`--tensor-parallel-size N` serves over N ranks in both modes' server.

    python bench/gpu_serve.py --load-test                          # on a GPU
    python bench/gpu_serve.py --load-test --tiny --device cpu --clients 4 --requests 8
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
              max_model_len=args.prompt_len + args.new_tokens + 1, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for b, ids in batches.items():
        def run(ids=ids):
            results = llm.generate(ids, params)
            assert all(len(r.token_ids) == args.new_tokens for r in results)
        out[str(b)] = _figures(timed(run, args.device, args.repeats), b, args.new_tokens)
    llm.close()
    decoder = llm.engine.decoder
    out["graph_replays"] = decoder.replays if decoder is not None else 0
    out["eager_bucket_runs"] = decoder.eager_runs if decoder is not None else 0
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """`tessera serve` on the bench's model in a subprocess, up until the `with` block ends."""

    def __init__(self, model_dir: Path, args, max_num_seqs: int, max_model_len: int, log: Path):
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "tessera", "serve", str(model_dir), "--port", str(port),
                    "--served-model-name", "bench", "--log-level", "warning", "--dtype", args.dtype, "--device",
                    args.device, "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
                    "--tensor-parallel-size", str(args.tensor_parallel_size)]
        if args.enforce_eager:
            self.cmd.append("--enforce-eager")
        self.args, self.log = args, log

    def __enter__(self) -> _Server:
        self.log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=self.log_file,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.args.server_start_timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"tessera serve did not come up: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log_file.close()


def bench_http(model_dir: Path, args, batches: dict[int, list[list[int]]], log: Path) -> dict[str, Any]:
    with _Server(model_dir, args, max(batches), args.prompt_len + args.new_tokens + 1, log) as server:
        url = server.url

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


def load_prompts(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of lengths prompt_len/4 .. 2*prompt_len; every other one starts with one shared
    prefix of prompt_len tokens (its own tokens follow), the rest are unique throughout."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    out = []
    for i in range(n):
        length = rng.randint(max(1, prompt_len // 4), 2 * prompt_len)
        own = [rng.randrange(3, vocab) for _ in range(length)]
        out.append(shared + own if i % 2 == 0 else own)
    return out


def _percentiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(v)}


def bench_load(model_dir: Path, args, vocab: int, log: Path) -> dict[str, Any]:
    """`--clients` concurrent streaming clients over `--requests` requests (module docstring)."""
    bodies = load_prompts(args.requests, args.prompt_len, vocab)
    max_len = 3 * args.prompt_len + args.new_tokens + 1
    with _Server(model_dir, args, args.clients, max_len, log) as server:
        async def one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[float, float, int]:
            body = {"model": "bench", "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            start, first, chunks = time.perf_counter(), None, 0
            async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if json.loads(line[6:])["choices"][0].get("text"):
                        chunks += 1
                        first = first or time.perf_counter()
            end = time.perf_counter()
            ttft = (first or end) - start
            return ttft, (end - (first or end)) / max(1, args.new_tokens - 1), chunks

        async def run_all() -> list[tuple[float, float, int]]:
            queue: asyncio.Queue = asyncio.Queue()
            for b in bodies:
                queue.put_nowait(b)
            results = []
            limits = httpx.Limits(max_connections=args.clients)
            async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
                async def worker():
                    while not queue.empty():
                        results.append(await one(client, queue.get_nowait()))
                await asyncio.gather(*(worker() for _ in range(args.clients)))
            return results

        t = time.perf_counter()
        results = asyncio.run(run_all())
        wall = time.perf_counter() - t
    generated = args.requests * args.new_tokens
    return {"clients": args.clients, "requests": args.requests, "seconds": wall, "tokens_per_s": generated / wall,
            "ttft_s": _percentiles([r[0] for r in results]), "tpot_s": _percentiles([r[1] for r in results]),
            "streamed_chunks": sum(r[2] for r in results),
            "prompt_tokens": sum(len(b) for b in bodies)}


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
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the served model is split over")
    p.add_argument("--load-test", action="store_true", help="only the server, under concurrent streaming load")
    p.add_argument("--clients", type=int, default=64, help="--load-test: concurrent clients")
    p.add_argument("--requests", type=int, default=256, help="--load-test: requests in all")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here (add --tiny --device cpu for the CPU smoke test)")
    if not args.tiny and not args.device.startswith("cuda"):
        p.error(f"--device {args.device} without --tiny would benchmark the 1.15B model on the CPU (hours, and a "
                "4.6 GB model written to the temp directory): run it on a CUDA GPU, or add --tiny for the "
                "small-shape CPU smoke test")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 256)
    shape = TINY_SHAPE if args.tiny else SHAPE
    batches = {b: prompts(b, args.prompt_len, shape["vocab_size"]) for b in args.batches}
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir, shape, args.dtype)
        log = Path(tmp) / "server.log"
        runs = (("llm", lambda: bench_llm(model_dir, args, batches)),
                ("http", lambda: bench_http(model_dir, args, batches, log)),
                ("transformers_generate", lambda: bench_transformers(model_dir, args, batches)))
        if args.load_test:
            runs = (("load", lambda: bench_load(model_dir, args, shape["vocab_size"], log)),)
        sides = {}
        for name, side in runs:
            sides[name] = side()
            gc.collect()  # one side's weights and cache go before the next one loads
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    result = {"benchmark": "gpu_serve_load" if args.load_test else "gpu_serve", "tiny": args.tiny,
              "tensor_parallel_size": args.tensor_parallel_size, "dtype": args.dtype,
              "enforce_eager": args.enforce_eager,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "model": shape,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats, **sides}
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
