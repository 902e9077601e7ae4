"""Decode memory per request of a hybrid model against the same model with attention in every layer.

    PYTHONPATH=$PWD .venv/bin/python bench/hybrid_kv_memory.py --context 32768

Qwen3-Next-80B-A3B's shapes (48 layers, attention on every fourth: 2 key-value heads of dim 256;
Gated DeltaNet on the others: 16 key and 32 value heads of dim 128, convolution width 4), one
sequence of `--context` tokens in bf16 blocks of 16. Counted as the engine counts it
(`kv_cache.bytes_per_block`, `recurrent_state.bytes_per_slot`) and as allocated (`PagedKVCache` and
`RecurrentStatePool` built on the meta device, so nothing is really allocated, their bytes summed):
the hybrid's KV blocks plus its state slot against the all-attention model's KV blocks, and the
hybrid as counted before its linear-attention layers stopped getting KV stores. Issue 50's target:
hybrid <= 0.3x. `--model kimi-linear-48b-a3b`: Kimi Linear's preset instead (27 layers, latent
attention on 7 storing 32 heads' decompressed keys of 192 and values of 128 as the engine does; Kimi
delta attention on the others: 32 heads of 128, convolution width 4) against it with latent attention
in every layer. Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def qwen3_next_80b(hybrid: bool):
    from tessera.config import get_preset
    from tessera.config.recurrent import LinearAttentionConfig

    la = LinearAttentionConfig(layers=[i for i in range(48) if i % 4 != 3]) if hybrid else None
    return dataclasses.replace(get_preset("tiny-qwen3-next"), n_layers=48, dim=2048, n_heads=16, n_kv_heads=2,
                               head_dim=256, max_seq_len=262144, linear_attention=la)


def kimi_linear_48b(hybrid: bool):
    from tessera.config import get_preset

    cfg = get_preset("kimi-linear-48b-a3b")
    return cfg if hybrid else dataclasses.replace(cfg, linear_attention=None, nope_layers=list(range(cfg.n_layers)))


MODELS = {"qwen3-next-80b-a3b": qwen3_next_80b, "kimi-linear-48b-a3b": kimi_linear_48b}


def measure(cfg, context: int, block: int) -> dict:
    import torch

    from tessera.infer.scheduling.kv_cache import PagedKVCache, bytes_per_block
    from tessera.infer.scheduling.recurrent_state import RecurrentStatePool, bytes_per_slot, is_hybrid

    blocks = -(-context // block)
    counted_kv, counted_state = blocks * bytes_per_block(cfg, block, torch.bfloat16, False), bytes_per_slot(
        cfg, torch.bfloat16)
    kv = PagedKVCache(cfg, blocks, block, torch.bfloat16, "meta")
    state = 0
    if is_hybrid(cfg):
        pool = RecurrentStatePool(cfg, 1, torch.bfloat16, "meta")
        state = sum(t.numel() * t.element_size() for fields in pool.tensors.values() for t in fields.values())
    allocated_kv = sum(t.numel() * t.element_size() for t in kv.stores())
    return {"kv_bytes": counted_kv, "state_bytes": counted_state, "total_bytes": counted_kv + counted_state,
            "allocated_bytes": allocated_kv + state}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-next-80b-a3b")
    args = p.parse_args(argv)
    hybrid = measure(MODELS[args.model](True), args.context, args.block_size)
    full = measure(MODELS[args.model](False), args.context, args.block_size)
    before = full["kv_bytes"] + hybrid["state_bytes"]  # every layer's KV counted, and the state slot
    print(json.dumps({"model": args.model, "context": args.context, "hybrid": hybrid, "all_attention": full,
                      "hybrid_over_all_attention": hybrid["total_bytes"] / full["total_bytes"],
                      "before_over_all_attention": before / full["total_bytes"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
