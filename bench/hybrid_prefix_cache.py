"""Serving requests that share a long prompt prefix with a hybrid model, with and without prefix caching.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/hybrid_prefix_cache.py --prefix 1024 --requests 8

A random Qwen3-Next-shaped model in memory (`--dim`, `--layers`: Gated DeltaNet on three of every four
layers), fp32 on the CPU. `--requests` prompts, each the same `--prefix` tokens and a tail of its own
(`--tail` tokens), served one after another (each the engine's only request), `--max-tokens` greedy
tokens each; once with prefix caching (the recurrent state's snapshots at block boundaries,
infer/scheduling/state_snapshots.py) and once without, in the same run. Reports each run's wall
seconds, the prompt tokens the cache supplied, the ratio of the two times, and whether both gave the
same tokens. Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_model(dim: int, layers: int):
    from tessera.config import get_preset
    from tessera.models import Transformer

    base = get_preset("tiny-qwen3-next")
    la = dataclasses.replace(base.linear_attention, layers=[i for i in range(layers) if i % 4 != 3],
                             n_key_heads=4, n_value_heads=8, key_head_dim=dim // 8, value_head_dim=dim // 8)
    cfg = dataclasses.replace(base, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=2, head_dim=dim // 8,
                              ffn_dim=2 * dim, max_seq_len=8192, linear_attention=la,
                              moe=dataclasses.replace(base.moe, ffn_dim=dim, shared_ffn_dim=dim))
    return Transformer(cfg, init_seed=0).eval()


def serve(model, prompts: list[list[int]], max_tokens: int, prefix_caching: bool) -> dict:
    from tessera.infer import LLM, SamplingParams

    llm = LLM(model, block_size=16, enable_prefix_caching=prefix_caching, max_model_len=len(prompts[0]) + max_tokens,
              max_num_seqs=2, kv_cache_gib=0.25)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    tokens = [llm.generate([p], params)[0].token_ids for p in prompts]
    seconds = time.perf_counter() - start
    cache = llm.engine.blocks.cache
    return {"seconds": seconds, "cached_prompt_tokens": 0 if cache is None else cache.hit_tokens, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--tail", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)
    import torch

    model = build_model(args.dim, args.layers)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.cfg.vocab_size, (args.prefix,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, model.cfg.vocab_size, (args.tail,), generator=gen).tolist()
               for _ in range(args.requests)]
    on = serve(model, prompts, args.max_tokens, True)
    off = serve(model, prompts, args.max_tokens, False)
    print(json.dumps({"prefix": args.prefix, "tail": args.tail, "requests": args.requests,
                      "with_cache": {k: v for k, v in on.items() if k != "tokens"},
                      "without_cache": {k: v for k, v in off.items() if k != "tokens"},
                      "speedup": off["seconds"] / on["seconds"], "same_tokens": on["tokens"] == off["tokens"]},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
