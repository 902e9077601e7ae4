"""Tessera's engine vs vLLM's CPU build without a server: the same batches through each offline API.

    PYTHONPATH=$PWD .venv/bin/python bench/offline_vs_vllm.py --model /tmp/llama110m \\
        --vllm-python /opt/vllm-venv/bin/python

`bench/serve_vs_vllm.py` measures the servers; this measures the engines alone, to tell the
engine's cost from the server's: `tessera.infer.LLM.generate` and `vllm.LLM.generate` (V1 engine
in the calling process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`), fp32, prefix caching off, the same
`--max-num-seqs` / `--max-num-batched-tokens` / `--max-model-len`, `--threads` compute threads
(vLLM's bound to cores 0..threads-1). Each engine runs in a process of its own, in the order
Tessera, vLLM, vLLM, Tessera (A B B A), and times three workloads after one warm-up batch:
- prefill: `--prefill-requests` prompts of `--prefill-tokens` random token ids, one output token
  (prompt chunks of the whole token budget, nothing else);
- decode_N for each N of `--decode-rows`: N prompts of 32 tokens, `--decode-tokens` greedy output
  tokens each, end-of-sequence ignored (decode steps of N rows).
The prompts are drawn from one seed, so both engines see the same token ids. Reports the wall
seconds of each workload per run and Tessera / vLLM per pair (below 1: Tessera faster). vLLM is
not a dependency: without a python that imports it the script says how to install it
(bench/serve_vs_vllm.py) and exits 0 having measured nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ORDER = ("tessera", "vllm", "vllm", "tessera")  # A B B A


def workloads(args) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts as token ids, output tokens), the same for both engines."""
    rng = random.Random(args.seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(10, args.vocab_limit) for _ in range(length)] for _ in range(n)]

    out = {"prefill": (prompts(args.prefill_requests, args.prefill_tokens), 1)}
    for n in args.decode_rows:
        out[f"decode_{n}"] = (prompts(n, 32), args.decode_tokens)
    return out


def run_engine(side: str, args) -> dict[str, float]:
    """In this process: build `side`'s engine, warm it up, time every workload (wall seconds)."""
    common = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len)
    if side == "tessera":
        import torch

        from tessera.infer import LLM, SamplingParams
        from tessera.infer.cpu.memory import keep_freed_memory

        keep_freed_memory()  # as `tessera serve` does on CPU
        torch.set_num_threads(args.threads)
        llm = LLM(str(args.model), kv_cache_gib=float(args.kv_cache_gib), enable_prefix_caching=False, **common)

        def generate(prompts: list[list[int]], n: int) -> None:
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    else:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(str(args.model), dtype="float32", enable_prefix_caching=False, **common)

        def generate(prompts: list[list[int]], n: int) -> None:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                         SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    generate([[11 + i for i in range(64)]] * 4, 4)  # warm-up: lazy start-up work out of the way
    times = {}
    for name, (prompts, n) in workloads(args).items():
        t0 = time.perf_counter()
        generate(prompts, n)
        times[name] = round(time.perf_counter() - t0, 3)
    return times


def child_command(side: str, args, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    python = sys.executable if side == "tessera" else args.vllm_python
    cmd = [python, str(Path(__file__).resolve()), *argv, "--child", side]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if side == "tessera":
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
    else:
        env.pop("PYTHONPATH", None)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    return cmd, env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="model directory both engines load")
    p.add_argument("--vllm-python", default=os.environ.get("TESSERA_VLLM_PYTHON"))
    p.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prefill-requests", type=int, default=16)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-rows", type=int, nargs="+", default=[8, 32])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--vocab-limit", type=int, default=4000, help="prompt ids are drawn from 10..this")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--child", choices=ORDER[:2], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_engine(args.child, args)), flush=True)
        return 0
    from bench.serve_vs_vllm import INSTALL, vllm_version

    version = vllm_version(args.vllm_python)
    if version is None:
        print(f"skipped: no python with vLLM (--vllm-python {args.vllm_python!r})\n{INSTALL}", file=sys.stderr)
        return 0
    runs = []
    for i, side in enumerate(ORDER):
        cmd, env = child_command(side, args, argv)
        load = os.getloadavg()[0]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stdout[-2000:] + done.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"the {side} run failed (exit {done.returncode})")
        times = json.loads(lines[-1][len("RESULT "):])
        runs.append({"side": side, "pair": 1 if i < 2 else 2, "load_before": round(load, 2), "seconds": times})
        print(f"{side} pair {runs[-1]['pair']}: {json.dumps(times)} (load {load:.2f})", flush=True)
    ratios = []
    for pair in (1, 2):
        t, v = (next(r["seconds"] for r in runs if r["side"] == s and r["pair"] == pair) for s in ORDER[:2])
        ratios.append({name: round(t[name] / v[name], 3) for name in t})
    print("tessera / vllm (wall seconds, below 1: Tessera faster):", json.dumps(ratios))
    if args.out is not None:
        args.out.write_text(json.dumps({"command": "python bench/offline_vs_vllm.py " + " ".join(argv),
                                        "vllm": version, "runs": runs, "ratios": ratios}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
