"""Prefill/decode disaggregation against one instance, under a mixed load.

    python bench/disaggregation.py --out disagg.json

The same model (a random LLaMA-style model with a character tokenizer, `--dim`, `--layers`) served
two ways, alternated A B B A:
- one: one `tessera serve` process with OMP_NUM_THREADS=2;
- pair: `tessera serve --kv-role prefill` and `--kv-role decode` with OMP_NUM_THREADS=1 each (the
  same two cores between them) behind `tessera router`.
The load, all at once: `--long` requests with long prompts and few output tokens, and `--short`
requests with short prompts and many output tokens. Reported: the short requests' time per output
token (how much the long prefills slow everyone's decode), the long requests' time to first token,
and the wall time of the whole load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stream_client import free_port, one_request, percentile, wait_healthy  # noqa: E402

KV_PEER_SECRET = secrets.token_hex(32)  # shared by the pair and the router (tessera/infer/scheduling/kv_peer.py)


def start(argv: list[str], threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT),
           "TESSERA_KV_PEER_SECRET": KV_PEER_SECRET}
    return subprocess.Popen([sys.executable, "-m", "tessera", *argv, "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def launch(kind: str, model: Path, engine: list[str]) -> tuple[list[subprocess.Popen], str]:
    common = ["serve", str(model), "--served-model-name", "bench", *engine]
    if kind == "one":
        port = free_port()
        return [start([*common, "--port", str(port)], 2)], f"http://127.0.0.1:{port}"
    p1, p2, p3 = free_port(), free_port(), free_port()
    procs = [start([*common, "--port", str(p1), "--kv-role", "prefill"], 1),
             start([*common, "--port", str(p2), "--kv-role", "decode", "--kv-offload-gib", "1"], 1)]
    for p in (p1, p2):
        wait_healthy(f"http://127.0.0.1:{p}")
    procs.append(start(["router", "--prefill", f"http://127.0.0.1:{p1}", "--decode", f"http://127.0.0.1:{p2}",
                        "--port", str(p3)], 1))
    return procs, f"http://127.0.0.1:{p3}"


async def load(url: str, args, salt: int) -> dict:
    long_prompts = [f"{salt}-{i} " + "def function(argument): return argument * 2\n" * (args.long_chars // 45)
                    for i in range(args.long)]
    short_prompts = [f"{salt}-{i} short question" for i in range(args.short)]
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one_request(client, p, args.long_tokens) for p in long_prompts],
                                       *[one_request(client, p, args.short_tokens) for p in short_prompts])
        wall = time.perf_counter() - t0
    assert all(r["ok"] for r in results), results
    long_r, short_r = results[:args.long], results[args.long:]
    return {"wall_s": wall, "long_ttft_p50_s": percentile([r["ttft"] for r in long_r], 50),
            "short_tpot_p50_s": percentile([r["tpot"] for r in short_r if r["tpot"]], 50),
            "short_ttft_p50_s": percentile([r["ttft"] for r in short_r], 50)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--long-chars", type=int, default=1500)
    p.add_argument("--long-tokens", type=int, default=4)
    p.add_argument("--short", type=int, default=4)
    p.add_argument("--short-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from bench.serve import build_model

    work = Path(tempfile.mkdtemp())
    model = work / "model"
    args.train_steps = 0
    info = build_model(model, args, "x")
    engine = ["--max-num-batched-tokens", "512", "--max-model-len", "2048"]
    runs: dict[str, list[dict]] = {"one": [], "pair": []}
    for i, kind in enumerate(["one", "pair", "pair", "one"]):
        procs, url = launch(kind, model, engine)
        try:
            wait_healthy(url)
            asyncio.run(load(url, args, 1000 + i))  # warm-up (the pair's first import, the decode graphs)
            runs[kind].append(asyncio.run(load(url, args, i)))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(60)
    summary = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "model_params": info["params"],
              "load": vars(args) | {"out": None}, "runs": runs, "median": summary,
              "pair_over_one": {k: summary["pair"][k] / summary["one"][k] for k in summary["one"]}}
    print(json.dumps(result, indent=2, default=str))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
