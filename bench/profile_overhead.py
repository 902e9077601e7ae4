"""What recording a profile (`tessera train ... --profile A:B`) costs the steps it records.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/profile_overhead.py [--rounds 5] [--steps 6] [--set key=value ...]

The tiny dense config (by default 2 layers of dim 256, sequences of 128, 4 samples a step, so that a
step takes a fraction of a second on a CPU) trains `--steps` steps on two forked gloo ranks
(parallel.dp_shard=2: FSDP's all-gathers and reduce-scatters are the collectives timed; parallel.tp=2:
DTensor's functional all-reduces) and in one process, every other step recorded
(`StepRecorder.step_block`, as `--profile` does), so that the machine's load falls on both alike; on
ranks every step starts at a barrier. A step's time is rank 0's wall time of
`Trainer.train_step`, the first two steps left out (warm-up).

On ranks the collectives are timed by wrapping their entry points, the process groups' methods and
the functional collectives' operators (what `--profile` does); the cases `..._dispatch` time them by
the dispatch mode that sees every operator instead (what every layout used before), as a peer
measured in the same run. The cases' rounds alternate; `--cases` picks some.

Prints one JSON object: for each case the median over rounds of the ratio of the median recorded
step to the median plain step, and each round's ratio (`per_round`: the spread a shared machine gives).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
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

LAYOUTS = {"one": {}, "fsdp": {"parallel.dp_shard": 2}, "tp": {"parallel.tp": 2}}
CASES = {"two_ranks_fsdp": ("fsdp", False), "two_ranks_fsdp_dispatch": ("fsdp", True),
         "two_ranks_tp": ("tp", False), "two_ranks_tp_dispatch": ("tp", True), "one_process": ("one", False)}


def _alternate(overrides: list[str], steps: int, dispatch: bool = False) -> dict[str, float]:
    """Train `steps` steps, every other one recorded (on ranks, all start each step together); the
    median seconds of the plain and of the recorded steps after the first two (warm-up)."""
    import torch.distributed as dist

    trainer = Trainer(load_config(TINY_DENSE, overrides), profile=(1, 10**9))
    trainer.recorder.dispatch_mode = dispatch
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps):
        recorded = i % 2 == 1
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        with trainer.recorder.step_block(trainer.step + 1) if recorded else nullcontext():
            trainer.train_step()
        if i >= 2:
            times[recorded].append(time.perf_counter() - start)
    return {"plain_s": statistics.median(times[False]), "profiled_s": statistics.median(times[True])}


def _one_case(dataset: str, work: Path, steps: int, layout: str, extra: list[str], n: int, dispatch: bool) -> float:
    """Median recorded step / median plain step of one run of the case."""
    ranks = 1 if layout == "one" else 2
    run_dir = work / f"{layout}-{n}-{int(dispatch)}"
    overrides = shrink(dataset, run_dir, steps, **SIZE, **LAYOUTS[layout]) + extra
    out = (run_ranks(_alternate, ranks, overrides, steps, dispatch, timeout=600)[0] if ranks > 1
           else _alternate(overrides, steps))
    return out["profiled_s"] / out["plain_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = p.parse_args()
    torch.set_num_threads(1)
    out: dict = {"machine": platform.platform(), "torch": torch.__version__, "steps": args.steps, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dataset = build_small_dataset(work)
        cases = {name: CASES[name] for name in args.cases.split(",")}
        ratios: dict[str, list[float]] = {name: [] for name in cases}
        for n in range(args.rounds):
            for name, (layout, dispatch) in cases.items():
                ratios[name].append(_one_case(dataset, work, args.steps, layout, args.overrides, n, dispatch))
        for name, values in ratios.items():
            out["cases"][name] = {"profiled_over_plain": statistics.median(values),
                                  "per_round": [round(r, 4) for r in values]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
