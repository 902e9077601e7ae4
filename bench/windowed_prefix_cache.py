"""Serving requests that share a long prompt prefix with a sliding-window model: prefix caching over
the windowed pool (`--windowed-kv bounded`, tessera/infer/scheduling/window_blocks.py) against the
same pool without it (what the engine did before it kept window blocks with the prefix cache), and
`--windowed-kv kept` (every block in one pool, prefix caching as for any model), in the same run.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/windowed_prefix_cache.py --prefix 1024 --requests 8

A Gemma 3-shaped model in memory (five sliding-window layers of `--window` to one global; `--dim`,
random weights), fp32 on the CPU. `--requests` prompts, each the same `--prefix` tokens and a tail of
its own (`--tail` tokens), served one after another (each the engine's only request), `--max-tokens`
greedy tokens each. Per mode: wall seconds, the prompt tokens the cache supplied and those computed,
and the most blocks of the windowed pool in use at once (referenced, not counting kept ones nobody
uses); the time ratios against the pool without caching, and whether every mode gave the same
tokens. One request is served first, untimed, so that no run pays for building the CPU kernels.
Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_model(dim: int, window: int, context: int):
    from tessera.config import get_preset
    from tessera.models import Transformer

    cfg = get_preset("gemma3-1b", vocab_size=256, dim=dim, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=dim // 4,
                     ffn_dim=2 * dim, sliding_window=window, window_layers=[0, 1, 2, 3, 4], max_seq_len=context,
                     query_pre_attn_scalar=float(dim // 4), init_std=0.2)
    return Transformer(cfg, init_seed=0).eval()


def serve(model, prompts: list[list[int]], max_tokens: int, mode: str, caching: bool) -> dict:
    from tessera.infer import LLM, SamplingParams

    llm = LLM(model, block_size=16, enable_prefix_caching=caching, windowed_kv=mode, max_num_seqs=2,
              max_model_len=len(prompts[0]) + max_tokens, kv_cache_gib=0.25)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine, most = llm.engine, 0
    pool = engine.blocks.window
    start = time.perf_counter()
    tokens = []
    for p in prompts:
        engine.add_request(p, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens.append(out.token_ids)
            most = max(most, pool.num_used_blocks if pool is not None else 0)
    seconds = time.perf_counter() - start
    cache = engine.blocks.cache
    cached = 0 if cache is None else cache.hit_tokens
    return {"seconds": seconds, "cached_prompt_tokens": cached,
            "computed_prompt_tokens": sum(len(p) for p in prompts) - cached,
            "window_blocks_in_use_most": most, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--tail", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args(argv)
    import torch

    model = build_model(args.dim, args.window, args.prefix + args.tail + args.max_tokens)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 250, (args.prefix,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 250, (args.tail,), generator=gen).tolist() for _ in range(args.requests)]
    serve(model, prompts[:1], args.max_tokens, "bounded", False)  # warm-up: the CPU kernels built and loaded
    runs = {"bounded_cached": serve(model, prompts, args.max_tokens, "bounded", True),
            "bounded_uncached": serve(model, prompts, args.max_tokens, "bounded", False),
            "kept_cached": serve(model, prompts, args.max_tokens, "kept", True)}
    base = runs["bounded_uncached"]["seconds"]
    print(json.dumps({"prefix": args.prefix, "tail": args.tail, "requests": args.requests, "window": args.window,
                      "runs": {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in runs.items()},
                      "uncached_over": {k: base / r["seconds"] for k, r in runs.items()},
                      "same_tokens": all(r["tokens"] == base_r for r in runs.values()
                                         for base_r in [runs["bounded_uncached"]["tokens"]])}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
