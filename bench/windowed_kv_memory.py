"""Serving memory of a sliding-window model at a context several times its window: the KV bytes of
its local layers when they keep a ring of their window's slots (`--windowed-kv bounded`,
tessera/infer/scheduling/window_blocks.py), with prefix caching off and on, against the same model
keeping every block (`--windowed-kv kept`: each local layer then holds what a full-attention layer holds).

A Gemma 3-shaped model (five sliding-window layers to one global; tiny widths, random weights) serves
`--seqs` greedy requests of `--multiple` x `--window` positions each (a prompt of `--prompt-windows`
windows, fed in chunks of `--budget` tokens, the rest decoded). Per mode it reports, for the local
layers only:
- held: the most KV bytes the requests' blocks in those layers took at once, over every step
  (bounded: blocks of the windowed pool the running sequences hold, prompt chunks included; kept: the
  blocks of the one pool, as those layers store a key and value per position of every block);
- cached (bounded with prefix caching): the most bytes of kept window blocks no sequence holds (parked,
  evictable), the prefix cache's and not counted in held;
- allocated: the bytes of those layers' cache tensors, as the engine sized them for `--seqs`
  sequences of the context (bounded: the windowed pool's blocks; kept: the full pool's);
and that both modes decoded the same tokens. Memory is counted, not timed: any machine gives the same
figures.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/windowed_kv_memory.py
    (--window 512 --seqs 2 --budget 256; --prompt-windows 4 --budget 96: prompt chunks past the ring's first turn)
"""

from __future__ import annotations

import argparse
import json

import torch

from tessera.config import get_preset
from tessera.infer import LLM, SamplingParams
from tessera.models import Transformer


def model(window: int, context: int) -> Transformer:
    cfg = get_preset("gemma3-1b", vocab_size=256, dim=64, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=16,
                     ffn_dim=128, sliding_window=window, window_layers=[0, 1, 2, 3, 4], max_seq_len=context,
                     query_pre_attn_scalar=16.0, init_std=0.2)
    return Transformer(cfg, init_seed=0)


def serve(net: Transformer, mode: str, args, prefix: bool = False) -> dict:
    """Serve the requests under `mode`; the local layers' held, cached and allocated KV bytes and the tokens."""
    context = args.multiple * args.window
    llm = LLM(net, block_size=args.block_size, max_num_seqs=args.seqs, max_model_len=context,
              max_num_batched_tokens=args.budget, windowed_kv=mode, enable_prefix_caching=prefix)
    engine, local = llm.engine, [0, 1, 2, 3, 4]
    kv = engine.kv
    per_block = kv.layer_nbytes(local) // (kv.k[local[0]].shape[0] // args.block_size)  # bytes of a block in them
    gen = torch.Generator().manual_seed(1)
    prompt = args.prompt_windows * args.window
    params = SamplingParams(max_tokens=context - prompt, temperature=0.0, ignore_eos=True)
    seqs = [engine.scheduler.requests[engine.add_request(torch.randint(3, 250, (prompt,), generator=gen)
                                                         .tolist(), params)] for _ in range(args.seqs)]
    pool, most, cached = engine.blocks.window, 0, 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        held = (sum(len(pool.held(s)) for s in running) if pool is not None
                else sum(len(s.block_table) for s in running))
        most = max(most, held)
        cached = max(cached, len(pool.parked) if pool is not None else 0)
    return {"held_bytes": most * per_block, "cached_bytes": cached * per_block,
            "allocated_bytes": kv.layer_nbytes(local),
            "longest": max(len(s.token_ids) for s in seqs), "tokens": [s.output_ids for s in seqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--multiple", type=int, default=8, help="context = multiple x window")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    ap.add_argument("--prompt-windows", type=int, default=1, help="prompt length, in windows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    net = model(args.window, args.multiple * args.window)
    b, p, k = serve(net, "bounded", args), serve(net, "bounded", args, prefix=True), serve(net, "kept", args)
    print(json.dumps({
        "window": args.window, "context": args.multiple * args.window, "block_size": args.block_size,
        "seqs": args.seqs, "prompt": args.prompt_windows * args.window, "longest_sequence": b["longest"],
        "local_held_bytes": {"bounded": b["held_bytes"], "bounded_prefix": p["held_bytes"], "kept": k["held_bytes"]},
        "local_held_ratio": round(b["held_bytes"] / k["held_bytes"], 4),
        "local_held_ratio_prefix": round(p["held_bytes"] / k["held_bytes"], 4),
        "local_cached_bytes_prefix": p["cached_bytes"],
        "local_allocated_bytes": {"bounded": b["allocated_bytes"], "bounded_prefix": p["allocated_bytes"],
                                  "kept": k["allocated_bytes"]},
        "local_allocated_ratio": round(b["allocated_bytes"] / k["allocated_bytes"], 4),
        "local_allocated_ratio_prefix": round(p["allocated_bytes"] / k["allocated_bytes"], 4),
        "same_tokens": b["tokens"] == k["tokens"] == p["tokens"],
    }, indent=1))


if __name__ == "__main__":
    main()
