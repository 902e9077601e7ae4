"""`tessera router --policy cache_aware` against `--policy round_robin` over three replicas, on a
multi-turn workload with shared system prompts.

    PYTHONPATH=$PWD python bench/router.py --out router.json

The same model (a random LLaMA-style model with a character tokenizer, `--dim`, `--layers`) served by
three `tessera serve` processes (OMP_NUM_THREADS=1 each); in front of them a router per round, the
policies alternated A B B A (`--rounds`). Each round: `--conversations` conversations at once, each
opening with one of `--system-prompts` system prompts (`--system-chars` characters, new ones each
round so that no replica holds them from an earlier round) and going on for `--turns` turns, each
turn a streamed /v1/completions of the whole conversation so far (`--turn-chars` more characters of
question, `--answer-tokens` tokens of answer). Reported: time to first token (p50, p90) over every
turn, the wall time of the round and the answer tokens per second; the ratios cache-aware / round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stream_client import free_port, one_request, percentile, wait_healthy  # noqa: E402


def start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tessera", *argv, "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + "      ") for _ in range(n))


async def conversation(client: httpx.AsyncClient, system: str, k: int, args, rng: random.Random) -> list[dict]:
    text, results = f"<system>{system}\n", []
    for turn in range(args.turns):
        text += f"<user {k}.{turn}>{_text(rng, args.turn_chars)}\n<assistant>"
        r = await one_request(client, text, args.answer_tokens)
        assert r["ok"], r
        results.append(r)
        text += "answer\n"  # a fixed continuation: both policies are sent the same prompts
    return results


async def one_round(url: str, args, salt: int) -> dict:
    rng = random.Random(salt)
    systems = [_text(rng, args.system_chars) for _ in range(args.system_prompts)]
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[conversation(client, systems[k % len(systems)], k, args,
                                                   random.Random(salt * 1000 + k)) for k in range(args.conversations)])
        wall = time.perf_counter() - t0
    turns = [r for run in runs for r in run]
    ttft = [r["ttft"] for r in turns]
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in turns) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--system-prompts", type=int, default=3)
    p.add_argument("--system-chars", type=int, default=1200)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-chars", type=int, default=100)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="alternated cache_aware, round_robin, round_robin, ...")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from bench.serve import build_model

    work = Path(tempfile.mkdtemp())
    model = work / "model"
    args.train_steps = 0
    info = build_model(model, args, "x")
    ports = [free_port() for _ in range(3)]
    replicas = [start(["serve", str(model), "--served-model-name", "bench", "--port", str(port),
                       "--max-model-len", "2048", "--max-num-batched-tokens", "512"]) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    order = ["cache_aware", "round_robin", "round_robin", "cache_aware"] * args.rounds
    runs: dict[str, list[dict]] = {"cache_aware": [], "round_robin": []}
    try:
        for url in urls:
            wait_healthy(url)
        for i, policy in enumerate(order[:args.rounds]):
            port = free_port()
            router = start(["router", *[a for u in urls for a in ("--replica", u)], "--policy", policy,
                            "--port", str(port)])
            try:
                wait_healthy(f"http://127.0.0.1:{port}")
                if i == 0:
                    asyncio.run(one_round(f"http://127.0.0.1:{port}", args, 10_000))  # warm-up
                runs[policy].append(asyncio.run(one_round(f"http://127.0.0.1:{port}", args, i)))
                print(policy, runs[policy][-1], flush=True)
            finally:
                router.terminate()
                router.wait(60)
    finally:
        for proc in replicas:
            proc.terminate()
            proc.wait(60)
    median = {policy: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for policy, rs in runs.items()}
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "model_params": info["params"],
              "load": vars(args) | {"out": None}, "runs": runs, "median": median,
              "cache_aware_over_round_robin": {k: median["cache_aware"][k] / median["round_robin"][k]
                                               for k in median["cache_aware"]}}
    print(json.dumps(result, indent=2, default=str))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
