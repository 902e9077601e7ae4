"""Serving benchmark: a load generator against `tessera serve` on 127.0.0.1, plus the figures
that need a peer measured in the same run.

    python bench/serve.py --out bench_serve.json            # small CPU run, a few minutes
    python bench/serve.py --model DIR --num-requests 200    # any served model directory

What it does (every phase bounded in requests and time; the whole run stops by itself):
1. the model: `--model DIR`, or a small LLaMA-style model trained here for `--train-steps` steps
   on Python standard-library source with a character tokenizer (so its text, its perplexity
   and its repetitions are real), saved as a HuggingFace directory;
2. perplexity on held-out text in full precision, with int8 weights, with an int8 KV cache;
3. HuggingFace `generate` decode speed on the same model, in this process (alternating with 4.);
4. servers started as subprocesses (prefix caching on; off; prompt-lookup speculation), driven
   by N concurrent streaming clients with and without a shared long prefix: throughput, TTFT,
   TPOT at p50/p99, and single-stream decode speed;
5. three ratios: TTFT with/without prefix reuse on prompts sharing a long prefix, speculative
   decode speed-up on repetitive text, single-stream decode speed vs HuggingFace `generate`
   (through the server, and in process with `tessera.infer.LLM`; measured alternately with the
   peer so that load on a shared machine affects both alike).
Results go to `--out` as JSON and are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stream_client import free_port, one_request, percentile  # noqa: E402
from tessera.config.model import ModelConfig  # noqa: E402
from tessera.data.corpus import select_stdlib_files  # noqa: E402
from tessera.hf import save_pretrained  # noqa: E402
from tessera.infer import EngineConfig, LLMEngine  # noqa: E402
from tessera.infer.engine.perplexity import perplexity  # noqa: E402
from tessera.models.transformer import Transformer  # noqa: E402

SPECIALS = ["<s>", "</s>", "<unk>"]
# Text that repeats itself; what the speculation gains depends on how far the model's own
# continuation repeats it, so the figure is over several such prompts.
REPETITIVE = ["for i in range(10):\n    total = total + values[i]\n" * 12, "x = 1\n" * 20,
              "self.assertEqual(a, b)\n" * 10, "import os\n" * 10, "    pass\n" * 30]


# ---- model --------------------------------------------------------------------------------------
def write_char_tokenizer(path: Path) -> int:
    """A character tokenizer (specials, tab, newline, printable ASCII) saved as tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    chars = ["\t", "\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "unk_token": "<unk>"}))
    return len(vocab)


def stdlib_texts(max_bytes: int) -> tuple[str, str]:
    """(training text, held-out text): the first 90% of the selected stdlib files, then the rest."""
    files = select_stdlib_files(max_bytes)
    cut = int(len(files) * 0.9)
    read = lambda fs: "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in fs)  # noqa: E731
    return read(files[:cut]), read(files[cut:])


def build_model(out: Path, args, train_text: str) -> dict:
    tok_dir = out.parent / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    vocab = write_char_tokenizer(tok_dir)
    cfg = ModelConfig(family="llama", vocab_size=vocab, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 32,
                      n_kv_heads=max(1, args.dim // 64), ffn_dim=args.dim * 3, max_seq_len=2048, rope_theta=10000.0)
    model = Transformer(cfg, init_seed=0)
    from tessera.data.tokenizer import Tokenizer

    ids = torch.tensor(Tokenizer.from_path(tok_dir).encode(train_text, add_special_tokens=False))
    info = {"params": sum(p.numel() for p in model.parameters()), "config": cfg.to_dict(),
            "train_steps": args.train_steps, "train_tokens": len(ids)}
    if args.train_steps:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        gen = torch.Generator().manual_seed(0)
        t0, seq = time.perf_counter(), args.train_seq
        for step in range(args.train_steps):
            lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.train_steps))
            for g in opt.param_groups:
                g["lr"] = lr
            starts = torch.randint(0, len(ids) - seq - 1, (args.train_batch,), generator=gen)
            x = torch.stack([ids[s:s + seq] for s in starts.tolist()])
            y = torch.stack([ids[s + 1:s + seq + 1] for s in starts.tolist()])
            loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 50 == 0 or step == args.train_steps - 1:
                print(f"  train step {step:4d}  loss {loss.item():.3f}", flush=True)
        info.update(train_seconds=round(time.perf_counter() - t0, 1), final_train_loss=round(loss.item(), 4))
    save_pretrained(model.eval(), out)
    write_char_tokenizer(out)
    return info


# ---- perplexity ---------------------------------------------------------------------------------
def perplexity_figures(model_dir: Path, text: str, tokens: int) -> dict:
    out = {}
    for name, opts in {"full_precision": {}, "int8_weights": {"quantization": "int8"},
                       "int8_kv_cache": {"kv_cache_dtype": "int8"},
                       "int8_weights_and_kv": {"quantization": "int8", "kv_cache_dtype": "int8"}}.items():
        engine = LLMEngine.from_dir(model_dir, EngineConfig(max_model_len=512, num_blocks=64, **opts))
        ids = engine.tokenizer.encode(text, add_special_tokens=False)[:tokens]
        out[name] = round(perplexity(engine, ids, chunk=64), 4)
    base = out["full_precision"]
    out["change_percent"] = {k: round(100 * (v / base - 1), 3) for k, v in out.items() if k != "full_precision"}
    out["tokens"] = tokens
    return out


# ---- single-stream decode peers ----------------------------------------------------------------
def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v)
    return round(values[len(values) // 2], 2) if values else None


class HFGenerate:
    """HuggingFace `generate` (greedy, its default attention) on the same model directory."""

    def __init__(self, model_dir: Path, prompt_ids: list[int]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.ids = torch.tensor([prompt_ids])
        self.timed(4)

    def timed(self, n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids), max_new_tokens=n,
                                do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    def decode_rate(self, n: int) -> float:
        """Decode tokens/s: (time(n) - time(1)) over n - 1 tokens, so prefill is left out."""
        return (n - 1) / (self.timed(n) - self.timed(1))


class InProcessEngine(HFGenerate):
    """`tessera.infer.LLM` in this process, measured the same way."""

    def __init__(self, model_dir: Path, prompt: str):
        from tessera.infer import LLM, SamplingParams

        self.llm, self.prompt, self.params = LLM(model_dir, max_model_len=2048), prompt, SamplingParams
        self.timed(4)

    def timed(self, n: int) -> float:
        t = time.perf_counter()
        self.llm.generate([self.prompt], self.params(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t


# ---- servers and clients ------------------------------------------------------------------------
class Server:
    def __init__(self, model_dir: Path, extra: list[str], threads: int, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(model_dir), "--port",
                                      str(self.port), "--served-model-name", "bench", "--log-level", "warning",
                                      *extra], env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become healthy in 120 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")


async def load_test(url: str, prompts: list[str], concurrency: int, max_tokens: int, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    queue = list(reversed(prompts))
    records: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue and time.monotonic() < deadline:
            try:
                records.append(await one_request(client, queue.pop(), max_tokens,
                                                  max(1.0, deadline - time.monotonic())))
            except httpx.HTTPError as e:
                records.append({"ok": False, "status": type(e).__name__})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return summarize(records, time.perf_counter() - t0, concurrency)


def pct(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p, 5)


def summarize(records: list[dict], wall: float, concurrency: int) -> dict:
    ok = [r for r in records if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    out = {"concurrency": concurrency, "requests": len(records), "completed": len(ok), "wall_s": round(wall, 3),
           "output_tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(ok) / wall, 3)}
    for key in ("ttft", "tpot", "latency"):
        vals = [r[key] for r in ok if r[key] is not None]
        out[f"{key}_p50_s"], out[f"{key}_p99_s"] = pct(vals, 50), pct(vals, 99)
    return out


def single_stream(urls: list[str], prompts: list[str], max_tokens: int, repeats: int) -> list[dict]:
    """For each server, decode tokens/s of one client alone (all decode tokens over all decode
    time, TTFT left out) over `repeats` passes through `prompts`; the servers take turns prompt by
    prompt, so that load drifts on a shared machine hit them alike."""
    async def run() -> list[list[dict]]:
        recs: list[list[dict]] = [[] for _ in urls]
        async with httpx.AsyncClient() as client:
            for _ in range(repeats):
                for p in prompts:
                    for url, out in zip(urls, recs):
                        client.base_url = url
                        out.append(await one_request(client, p, max_tokens, time.monotonic() + 300))
        return recs

    results = []
    for recs in asyncio.run(run()):
        recs = [r for r in recs if r["ok"] and r["tpot"]]
        decode_time = sum(r["tpot"] * (r["tokens"] - 1) for r in recs)
        rate = round(sum(r["tokens"] - 1 for r in recs) / decode_time, 2) if recs else None
        results.append({"decode_tokens_per_s": rate, "ttft_p50_s": pct([r["ttft"] for r in recs], 50),
                        "runs": len(recs)})
    return results


# ---- the run ------------------------------------------------------------------------------------
def workloads(held_out: str, n: int, prefix_chars: int) -> tuple[list[str], list[str]]:
    """(unique prompts, prompts sharing one long prefix), drawn from held-out text."""
    rng = random.Random(0)
    lines = [ln for ln in held_out.splitlines() if len(ln.strip()) > 20]
    unique = ["\n".join(rng.sample(lines, 4)) for _ in range(n)]
    prefix = held_out[:prefix_chars]
    shared = [prefix + f"\n# question {i}: " + rng.choice(lines).strip()[:40] for i in range(n)]
    return unique, shared


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="served model directory (default: build one)")
    p.add_argument("--out", type=Path, default=Path("bench_serve.json"))
    p.add_argument("--num-requests", type=int, default=48, help="requests per load test")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    p.add_argument("--max-tokens", type=int, default=48, help="completion tokens per request")
    p.add_argument("--prefix-chars", type=int, default=1200, help="length of the shared prefix")
    p.add_argument("--decode-tokens", type=int, default=96, help="tokens of the single-stream decode runs")
    p.add_argument("--paired-requests", type=int, default=24, help="prompts of the paired TTFT measurement")
    p.add_argument("--repeats", type=int, default=3, help="passes of the single-stream measurements")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server and of HF generate")
    p.add_argument("--phase-seconds", type=float, default=120, help="time limit of each load test")
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--train-seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    train_text, held_out = stdlib_texts(3_000_000)
    result: dict = {"command": "python bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                                "threads": args.threads}}
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as work:
        work = Path(work)
        model_dir = args.model
        if model_dir is None:
            print("building the model", flush=True)
            model_dir = work / "model"
            result["model"] = build_model(model_dir, args, train_text)
        print("perplexity", flush=True)
        result["perplexity"] = perplexity_figures(model_dir, held_out, args.ppl_tokens)
        from tessera.data.tokenizer import Tokenizer

        tok = Tokenizer.from_path(model_dir)
        decode_prompt = held_out[:200]
        unique, shared = workloads(held_out, args.num_requests, args.prefix_chars)
        common = ["--max-num-seqs", str(max(args.concurrency, 8)), "--max-model-len", "2048"]
        print("servers: prefix caching on / off / prompt-lookup speculation", flush=True)
        spec = ["--speculative", "prompt_lookup", "--num-speculative-tokens", "4"]
        with contextlib.ExitStack() as stack:  # all three up at once: paired runs alternate between them
            a = stack.enter_context(Server(model_dir, common, args.threads, work / "server_a.log"))
            b = stack.enter_context(Server(model_dir, common + ["--no-prefix-caching"], args.threads,
                                           work / "server_b.log"))
            c = stack.enter_context(Server(model_dir, common + spec, args.threads, work / "server_c.log"))
            print("single-stream decode vs HuggingFace generate", flush=True)
            hf, local = HFGenerate(model_dir, tok.encode(decode_prompt)), InProcessEngine(model_dir, decode_prompt)
            served, peer, inproc = [], [], []
            for _ in range(args.repeats):
                served.append(single_stream([a.url], [decode_prompt], args.decode_tokens, 1)[0]["decode_tokens_per_s"])
                peer.append(hf.decode_rate(args.decode_tokens))
                inproc.append(local.decode_rate(args.decode_tokens))
            del hf, local
            plain, specd = single_stream([a.url, c.url], REPETITIVE, args.decode_tokens, args.repeats)
            result["single_stream"] = {"server_decode_tokens_per_s": median(served),
                                       "in_process_decode_tokens_per_s": median(inproc),
                                       "hf_generate_decode_tokens_per_s": median(peer),
                                       "tokens": args.decode_tokens, "repeats": args.repeats}
            result["single_stream_repetitive"] = plain
            result["single_stream_repetitive_speculative"] = {
                **specd, "acceptance_rate": c.metric("tessera_spec_acceptance_rate"),
                "tokens_per_step": c.metric("tessera_spec_tokens_per_step")}
            print("load tests", flush=True)
            result["load_unique_prompts"] = asyncio.run(
                load_test(a.url, unique, args.concurrency, args.max_tokens, args.phase_seconds))
            result["load_shared_prefix_reuse_off"] = asyncio.run(
                load_test(b.url, shared, args.concurrency, args.max_tokens, args.phase_seconds))
            result["load_shared_prefix_reuse_on"] = asyncio.run(
                load_test(a.url, shared, args.concurrency, args.max_tokens, args.phase_seconds))
            result["load_shared_prefix_reuse_on"]["prefix_cache_hit_rate"] = a.metric("tessera_prefix_cache_hit_rate")
            print("paired TTFT, shared prefix", flush=True)
            on_alone, off_alone = single_stream([a.url, b.url], shared[:args.paired_requests], 2, 1)
            result["shared_prefix_ttft_paired"] = {"requests": args.paired_requests,
                                                   "ttft_p50_reuse_on_s": on_alone["ttft_p50_s"],
                                                   "ttft_p50_reuse_off_s": off_alone["ttft_p50_s"]}
    on, off = result["load_shared_prefix_reuse_on"], result["load_shared_prefix_reuse_off"]
    rep, rep_spec = result["single_stream_repetitive"], result["single_stream_repetitive_speculative"]
    ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
    result["ratios"] = {
        "prefix_reuse_ttft_speedup_p50": ratio(result["shared_prefix_ttft_paired"]["ttft_p50_reuse_off_s"],
                                               result["shared_prefix_ttft_paired"]["ttft_p50_reuse_on_s"]),
        "prefix_reuse_ttft_speedup_p50_under_load": ratio(off["ttft_p50_s"], on["ttft_p50_s"]),
        "speculative_decode_speedup": ratio(rep_spec["decode_tokens_per_s"], rep["decode_tokens_per_s"]),
        "decode_vs_hf_generate_server": ratio(result["single_stream"]["server_decode_tokens_per_s"],
                                              result["single_stream"]["hf_generate_decode_tokens_per_s"]),
        "decode_vs_hf_generate_in_process": ratio(result["single_stream"]["in_process_decode_tokens_per_s"],
                                                  result["single_stream"]["hf_generate_decode_tokens_per_s"]),
    }
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("ratios", "perplexity")}, indent=2))
    for key, value in result.items():
        if key not in ("ratios", "perplexity", "command", "machine", "model"):
            print(f"{key}: {json.dumps(value)}")
    print(f"wrote {args.out} in {result['total_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
