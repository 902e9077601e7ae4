"""DualPipeV with its paired forward and backward overlapped (`parallel.pp_overlap`) vs run in turn, on CPU,
with an expert all-to-all made slow on purpose.

    OMP_NUM_THREADS=1 python bench/dualpipe_overlap.py [--delay-ms 20] [--steps 5] [--microbatches 8]

Four forked gloo ranks (tests.forked_ranks.run_ranks, one intra-op thread each): pp2 x ep2 (ep folded
over dp_shard = 2) under the distributed optimizer's layout (no FSDP), a small DeepSeek-style MoE model
(tiny-moe, 4 layers, 8 experts), one row per micro-batch. Every `all_to_all_single` of the ranks
first sleeps `--delay-ms` (a stand-in for a network all-to-all that takes as long as a layer's compute:
a sleep releases the GIL as a waiting collective does), so the overlapped pairs can hide one micro-
batch's exchanges behind the other's compute. Both schedules are built in the same ranks from the
same seed and take turns step by step (who goes first alternates), each step timed between
barriers; the figures are the median step of each and the median of the per-step ratios in turn /
overlapped. The first step's losses must agree (exit status 1 if not). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tessera.config import get_preset  # noqa: E402
from tessera.config.parallel import ParallelConfig  # noqa: E402
from tessera.models import Transformer  # noqa: E402
from tessera.parallel import ParallelDims, parallelize, shard_global_batch  # noqa: E402
from tessera.parallel.pipeline import build_pipeline  # noqa: E402
from tessera.train.objectives.loss import token_loss_sum  # noqa: E402
from tests.forked_ranks import run_ranks  # noqa: E402

WORLD = 4
MODEL = {"n_layers": 4, "dim": 128, "ffn_dim": 256}


def _slow_all_to_all(delay_s: float) -> None:
    """Every all-to-all of this rank waits `delay_s` first."""
    real = dist.all_to_all_single

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)

    dist.all_to_all_single = slow


def _build(overlap: bool, microbatches: int, rows: int, seq: int):
    pcfg = ParallelConfig(pp=2, dp_shard=2, ep=2, pp_schedule="dualpipev", optimizer="distributed",
                          pp_overlap=overlap)
    cfg = get_preset("tiny-moe", **MODEL)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    n_tokens = rows * seq
    run = build_pipeline(Transformer(cfg, init_seed=0), dims, pcfg, microbatches,
                         loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / n_tokens,
                         aux_scale=1.0 / (microbatches * dims.dp_size),
                         parallelize_stage=lambda m: parallelize(m, dims, pcfg))
    return run, dims, cfg.vocab_size


def _timed_step(run, rows: torch.Tensor) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    losses = run.step(rows[:, :-1], rows[:, 1:])
    dist.barrier()
    seconds = time.perf_counter() - start
    for p in run.parameters():
        p.grad = None
    return seconds, float(sum(x.detach() for x in losses)) if losses else 0.0


def _rank(delay_ms: float, steps: int, microbatches: int, seq: int) -> dict:
    torch.manual_seed(0)
    rows_total = 2 * microbatches  # one row per micro-batch on each of the two data-parallel ranks
    sides = {name: _build(name == "overlapped", microbatches, rows_total, seq) for name in ("overlapped", "in_turn")}
    _slow_all_to_all(delay_ms / 1000.0)
    times: dict[str, list[float]] = {name: [] for name in sides}
    first_loss: dict[str, float] = {}
    for step in range(steps + 1):  # step 0 warms up, untimed
        g = torch.Generator().manual_seed(step)
        batch = torch.randint(0, sides["overlapped"][2], (rows_total, seq + 1), generator=g)
        order = list(sides) if step % 2 == 0 else list(reversed(sides))
        for name in order:
            run, dims, _ = sides[name]
            seconds, loss = _timed_step(run, shard_global_batch(batch, dims))
            if step == 0:
                first_loss[name] = loss
            else:
                times[name].append(seconds)
    return {"times": times, "first_loss": first_loss,
            "pairs": sides["overlapped"][0].overlapped.pairs if sides["overlapped"][0].overlapped else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=20.0, help="sleep before every all-to-all (ms)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=8, help="per data-parallel rank (at least 2 pp = 4)")
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    results = run_ranks(_rank, WORLD, args.delay_ms, args.steps, args.microbatches, args.seq, timeout=1800)
    times = results[0]["times"]
    per_step = [a / b for a, b in zip(times["in_turn"], times["overlapped"], strict=True)]
    losses = [r["first_loss"] for r in results]
    same = all(abs(loss["overlapped"] - loss["in_turn"]) <= 1e-5 * max(abs(loss["in_turn"]), 1e-12)
               for loss in losses)
    out = {"delay_ms": args.delay_ms, "microbatches": args.microbatches, "seq": args.seq, "steps": args.steps,
           "step_s_overlapped": statistics.median(times["overlapped"]),
           "step_s_in_turn": statistics.median(times["in_turn"]),
           "in_turn_over_overlapped": statistics.median(times["in_turn"]) / statistics.median(times["overlapped"]),
           "median_per_step_ratio": statistics.median(per_step),
           "overlapped_pairs_per_step": results[0]["pairs"] // (args.steps + 1),
           "first_step_losses_agree": same, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
           "load_average": os.getloadavg()}
    print(json.dumps(out, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
