"""The CPU serving step of the 110M-parameter LLaMA of bench/serve_vs_vllm.py, timed in process.

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 .venv/bin/python bench/cpu_step.py --model /tmp/llama110m

Decode steps of `--rows` rows (contexts drawn from 32-640 tokens) and one `--chunk`-token prompt
chunk at position 512, each through the engine's own step (`PagedModel.forward_split`), with the
attention over the paged cache read in place by the C++ kernel and by PyTorch ops
(`TESSERA_CPU_ATTENTION=torch`), alternated in the same process, the minimum and median of
`--repeats` runs each. `--keep-freed` sets the allocator as `tessera serve` does on CPU
(cpu_memory.py); `--no-fuse` leaves q/k/v and gate/up as separate products; `--onednn` multiplies
with oneDNN's linear instead of the panel kernel (cpu_linear.py); `--no-layer-ops` leaves RMSNorm,
the rotary embedding and the activation to PyTorch ops (cpu_layer_ops.py). Run it once with and once
without a switch, alternately, to compare those (they are the process's, not the step's).
Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the model directory (written here if empty)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--keep-freed", action="store_true")
    p.add_argument("--no-fuse", action="store_true")
    p.add_argument("--onednn", action="store_true")
    p.add_argument("--no-layer-ops", action="store_true")
    args = p.parse_args(argv)

    import torch

    from bench.serve_vs_vllm import build_model
    from tessera.checkpoint.loading import load_model
    from tessera.infer import EngineConfig
    from tessera.infer.cpu import attention as cpu_attention
    from tessera.infer.cpu.layer_ops import fuse_layer_ops
    from tessera.infer.cpu.linear import fuse_projections, pack_linears
    from tessera.infer.cpu.memory import keep_freed_memory
    from tessera.infer.runner.paged_model import BatchItem, build_paged_model

    if args.keep_freed:
        keep_freed_memory()
    if not (args.model / "config.json").exists():
        build_model(args.model)
    model = load_model(args.model, torch.float32, "cpu").model.eval()
    pack_linears(model, onednn=args.onednn)
    if not args.no_fuse:
        fuse_projections(model)
    if not args.no_layer_ops:
        fuse_layer_ops(model)
    config = EngineConfig(kv_cache_gib=1.0, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024)
    paged, _ = build_paged_model(model, config)
    bs, rng, next_block = config.block_size, random.Random(0), 0
    cases = {}
    for n in args.rows:
        items = []
        for _ in range(n):
            length = rng.randint(32, 640)
            blocks = -(-(length + 1) // bs)
            items.append(BatchItem([rng.randrange(model.cfg.vocab_size)], length, list(range(next_block,
                                                                                              next_block + blocks))))
            next_block += blocks
        cases[f"decode_{n}_rows"] = items
    blocks = -(-(512 + args.chunk) // bs)
    cases[f"chunk_{args.chunk}_at_512"] = [BatchItem([rng.randrange(model.cfg.vocab_size) for _ in range(args.chunk)],
                                                     512, list(range(next_block, next_block + blocks)),
                                                     logits_from=args.chunk - 1)]
    assert cpu_attention.kernel() is not None, "the CPU attention kernel did not build"
    times: dict[str, dict[str, list[float]]] = {name: {"kernel": [], "torch": []} for name in cases}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, items in cases.items():
            for path in ("kernel", "torch"):
                if path == "torch":
                    os.environ[cpu_attention.ENV] = "torch"
                else:
                    os.environ.pop(cpu_attention.ENV, None)
                t = time.perf_counter()
                paged.forward_split(items)
                times[name][path].append(time.perf_counter() - t)
    result = {"threads": torch.get_num_threads(), "keep_freed": args.keep_freed, "fused": not args.no_fuse,
              "linear": "onednn" if args.onednn else "panel", "layer_ops": not args.no_layer_ops,
              "steps_ms": {name: {path: {"min": round(min(ts[1:]) * 1e3, 1),
                                         "median": round(sorted(ts[1:])[len(ts[1:]) // 2] * 1e3, 1)}
                                  for path, ts in paths.items()} for name, paths in times.items()}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
