"""What recording a profile (`tessera train ... --profile A:B`) costs the steps it records.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/profile_overhead.py [--rounds 5] [--steps 6] [--set key=value ...]

The tiny dense config (by default 2 layers of dim 256, sequences of 128, 4 samples a step, so that a
step takes a fraction of a second on a CPU) trains `--steps` steps on two forked gloo ranks
(parallel.dp_shard=2: FSDP's all-gathers and reduce-scatters are the collectives timed) and in one
process, once with steps 2..N recorded and once without, alternated round by round so that the
machine's load falls on both alike. A step's time is the rank's own (train/run/rank_timing.py's
`rank_step_s` on ranks, tokens / tokens_per_s in one process), the first step left out (warm-up).

Prints one JSON object: for each case the median over rounds of the profiled / plain step-time
ratio, and each round's ratio (`per_round`: the spread a shared machine gives).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.config.schema import load_config  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402
from tests.forked_ranks import run_ranks  # noqa: E402
from tests.train.runs import TINY_DENSE, build_small_dataset, shrink  # noqa: E402

SIZE = {"model.dim": 256, "model.ffn_dim": 512, "model.n_heads": 8, "model.n_kv_heads": 4, "model.max_seq_len": 128,
        "train.seq_len": 128, "train.micro_batch_size": 2, "train.global_batch_size": 4, "checkpoint.interval": 0}


def _step_times(records: list[dict], tokens: int) -> list[float]:
    """Seconds of each logged step after the first (metrics lines of every step: log_interval 1)."""
    out = []
    for r in records:
        if r["step"] < 2:
            continue
        out.append(max(r["rank_step_s"]) if "rank_step_s" in r else tokens / r["tokens_per_s"])
    return out


def _train(overrides: list[str], window: tuple[int, int] | None) -> list[dict]:
    trainer = Trainer(load_config(TINY_DENSE, overrides), profile=window)
    return trainer.train().records


def _one_case(dataset: str, work: Path, steps: int, ranks: int, extra: list[str], n: int) -> float:
    """Median profiled step / median plain step for run `n` of one case."""
    times = {}
    for profiled in (False, True):
        run_dir = work / f"r{ranks}-{n}-{int(profiled)}"
        overrides = shrink(dataset, run_dir, steps, **SIZE, **({"parallel.dp_shard": 2} if ranks > 1 else {}))
        overrides += extra
        window = (2, steps) if profiled else None
        records = (run_ranks(_train, ranks, overrides, window, timeout=600)[0] if ranks > 1
                   else _train(overrides, window))
        times[profiled] = statistics.median(_step_times(records, 4 * 128))
    return times[True] / times[False]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    torch.set_num_threads(1)
    out: dict = {"machine": platform.platform(), "torch": torch.__version__, "steps": args.steps, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dataset = build_small_dataset(work)
        for name, ranks in (("two_ranks_fsdp", 2), ("one_process", 1)):
            ratios = [_one_case(dataset, work, args.steps, ranks, args.overrides, n) for n in range(args.rounds)]
            out["cases"][name] = {"profiled_over_plain": statistics.median(ratios),
                                  "per_round": [round(r, 4) for r in ratios]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
