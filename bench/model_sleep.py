"""Waking a sleeping model against starting it cold, and what a sleeping model holds
(tessera/infer/engine/sleep.py, tessera/infer/fleet/model_registry.py).

    PYTHONPATH=$PWD python bench/model_sleep.py --out sleep.json

One model (a random LLaMA-style model with a character tokenizer, `--dim`, `--layers`, saved as a
HuggingFace directory) measured, alternated over `--rounds`:
- cold start: its engine thread built from the directory (`EngineLoop.build` of `LLMEngine.from_dir`:
  read, CPU weights packed, KV cache allocated), which is also what a wake from level 2 does;
- wake from level 1: `wake_level1` in the engine thread (KV cache allocated and zeroed again; on the
  CPU the weights never left);
each followed by one greedy request, whose tokens must equal the cold engine's. Reported: the
seconds of each (medians), their ratio, and the bytes held: weights and KV cache awake, at level 1
and at level 2 (none).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import torch

    from bench.serve import build_model
    from tessera.infer.config import EngineConfig
    from tessera.infer.engine.llm_engine import LLMEngine
    from tessera.infer.engine.loop import EngineLoop
    from tessera.infer.engine.sleep import kv_bytes, sleep_level1, wake_level1, weight_bytes
    from tessera.infer.sampling.params import SamplingParams

    work = Path(tempfile.mkdtemp())
    args.train_steps = 0
    info = build_model(work / "model", args, "x")
    config = EngineConfig(kv_cache_gib=args.kv_cache_gib)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def answer(loop: EngineLoop) -> list[int]:
        def run(engine):
            rid = engine.add_request(list(range(3, 40)), params)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        return out.token_ids
        return loop.call(run).result()

    cold, warm, reference, held = [], [], None, {}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        loop = EngineLoop.build(lambda: LLMEngine.from_dir(work / "model", config), torch.get_num_threads())
        cold.append(time.perf_counter() - t0)
        reference = reference or answer(loop)
        held["awake"] = {"weights": weight_bytes(loop.engine), "kv": kv_bytes(loop.engine)}
        slept = loop.call(sleep_level1).result()
        held["level1"] = {"weights": weight_bytes(loop.engine), "kv": kv_bytes(loop.engine)}
        t0 = time.perf_counter()
        loop.call(lambda e, slept=slept: wake_level1(e, slept)).result()
        warm.append(time.perf_counter() - t0)
        assert answer(loop) == reference, "woken from level 1, the model answered differently"
        loop.stop()
        loop.engine.close()
    held["level2"] = {"weights": 0, "kv": 0}  # the engine closed: nothing of it is held
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "model_params": info["params"],
              "load": vars(args) | {"out": None}, "cold_start_s": cold, "wake_level1_s": warm,
              "median": {"cold_start_s": statistics.median(cold), "wake_level1_s": statistics.median(warm)},
              "wake_level1_over_cold_start": statistics.median(warm) / statistics.median(cold), "bytes": held}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
