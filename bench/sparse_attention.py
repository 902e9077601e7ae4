"""DeepSeek-V3.2's sparse attention in the serving step on CPU: a decode reading its chosen tokens' keys
and values from their KV-cache slots (the gathered form) against reading its whole context and masking
all but the chosen (the masked form).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/sparse_attention.py

One layer of a paged KV cache (`--heads` heads of MLA's decompressed keys, dim 192, and values, dim 128, as
DeepSeek-V3.2's; fp32, blocks of 16) holding one sequence of `--context` tokens of random keys and values;
its decode query chooses `--topk` of them (sparse_mla.select_keys over random ReLU scores). The two forms of
tessera/infer/runner/sparse_attention.py alternate `--rounds` times over `--steps` decodes each, each side's
median kept: `_attend_chosen_slots` (the chosen slots gathered, sparse_gather.py) and the masked one
(`gather_flat` of the context's blocks, SDPA under the chosen mask). The indexer's scoring, the same in
both, is left out. Prints one JSON object: seconds per decode of each, their ratio, the largest difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from tessera.config import get_preset
    from tessera.infer.runner.sparse_attention import _attend_chosen_slots
    from tessera.infer.scheduling.kv_cache import PagedKVCache
    from tessera.models.attention_variants.sparse_mla import select_keys

    torch.set_num_threads(args.threads)
    base = get_preset("tiny-deepseek-v32")
    mla = {**vars(base.mla), "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_head_dim": 128}
    cfg = type(base)(**{**vars(base), "n_heads": args.heads, "n_layers": 1, "mla": mla})
    L, bs, gen = args.context, 16, torch.Generator().manual_seed(0)
    kv = PagedKVCache(cfg, L // bs, bs, torch.float32)
    slots = torch.randperm(L, generator=gen)  # the sequence's blocks anywhere in the pool, as a busy cache has them
    blocks = slots.view(-1, bs)[:, 0] // bs
    kv.write(0, (blocks[:, None] * bs + torch.arange(bs)).flatten(), torch.randn(L, args.heads, 192, generator=gen),
             torch.randn(L, args.heads, 128, generator=gen))
    q = torch.randn(1, args.heads, 192, generator=gen)
    chosen = select_keys(torch.randn(1, 1, L, generator=gen).relu(), torch.ones(1, 1, L, dtype=torch.bool),
                         args.topk)[0]

    def masked():
        k, v = kv.gather_flat(0, blocks, torch.float32)
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], attn_mask=chosen[None, None],
                                              scale=0.07)[0].transpose(0, 1)

    forms = {"masked": masked, "gathered": lambda: _attend_chosen_slots(kv, 0, blocks, q, chosen, args.topk, 0.07)}
    times: dict[str, list[float]] = {n: [] for n in forms}
    out = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in forms.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    out[name] = fn()
                times[name].append((time.perf_counter() - start) / args.steps)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(json.dumps({"context": L, "topk": args.topk, "heads": args.heads, "threads": args.threads,
                      "seconds_per_decode": med, "masked_over_gathered": med["masked"] / med["gathered"],
                      "max_abs_diff": float((out["masked"] - out["gathered"]).abs().max())}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
