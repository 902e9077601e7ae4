"""Time to first token of a long prompt whose prefix blocks come back from a KV tier, against the
same prompt computed from nothing (and found on the device, for scale).

    python bench/kv_tiers.py --out kv_tiers.json          # a 12-layer 512-wide LLaMA, 1024-token prompt

Phases, each repeated `--repeats` times, alternated so that load on a shared machine hits all alike:
- recompute: a fresh engine without tiers prefills the prompt;
- device: the same prompt again on that engine (its blocks still on the device);
- host: an engine with `kv_offload_gib`, whose device pool is so small that the prompts run after
  the first push every block of it out; the prompt again comes back from host memory;
- disk: an engine with `kv_cache_dir` prefills the prompt and is closed; a new engine over the same
  directory (a freshly started server: nothing on its device or in its host memory) serves it.
TTFT is measured in process (`LLMEngine.step` until the first token), with one output token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tessera.config.model import ModelConfig  # noqa: E402
from tessera.infer.config import EngineConfig  # noqa: E402
from tessera.infer.engine.llm_engine import LLMEngine  # noqa: E402
from tessera.infer.sampling.params import SamplingParams  # noqa: E402
from tessera.models.transformer import Transformer  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.add_request(prompt, ONE)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def engine(model: Transformer, args, **tiers) -> LLMEngine:
    blocks = -(-args.prompt_tokens // args.block_size) + 2
    cfg = EngineConfig(block_size=args.block_size, num_blocks=blocks, max_num_seqs=1, max_model_len=blocks *
                       args.block_size, max_num_batched_tokens=args.prompt_tokens + 16, decode_batch_sizes=[], **tiers)
    return LLMEngine.from_model(model, cfg)


def one_round(model: Transformer, prompt: list[int], others: list[list[int]], args, cache_root: Path) -> dict:
    out = {}
    plain = engine(model, args)
    out["recompute"] = ttft(plain, prompt)
    out["device"] = ttft(plain, prompt)
    host = engine(model, args, kv_offload_gib=args.offload_gib)
    ttft(host, prompt)
    for other in others:  # every block of the prompt leaves the device
        ttft(host, other)
    out["host"] = ttft(host, prompt)
    assert host.tier_metrics.host_hit_blocks >= len(prompt) // args.block_size - 1
    cache = Path(tempfile.mkdtemp(dir=cache_root))
    writer = engine(model, args, kv_cache_dir=str(cache))
    ttft(writer, prompt)
    writer.close()
    reader = engine(model, args, kv_cache_dir=str(cache))
    out["disk"] = ttft(reader, prompt)
    assert reader.tier_metrics.disk_hit_blocks >= len(prompt) // args.block_size - 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--offload-gib", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, n_kv_heads=
                      args.dim // 128, ffn_dim=args.dim * 8 // 3 // 64 * 64, max_seq_len=args.prompt_tokens + 64)
    model = Transformer(cfg).eval()
    rng = random.Random(0)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(args.prompt_tokens)]
    others = [[rng.randrange(cfg.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(2)]
    rounds = []
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.repeats):
            rounds.append(one_round(model, prompt, others, args, Path(root)))
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    params = sum(x.numel() for x in model.parameters()) / 1e6
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "model": f"LLaMA-style, dim {args.dim}, {args.layers} layers, {params:.1f}M parameters, fp32",
        "prompt_tokens": args.prompt_tokens, "block_size": args.block_size, "rounds": rounds,
        "ttft_median_s": med,
        "ratio_to_recompute": {k: med[k] / med["recompute"] for k in med},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
