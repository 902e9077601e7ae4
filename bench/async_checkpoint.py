"""Step time with a checkpoint save: none, synchronous, and in the background (`checkpoint.async`).

    python bench/async_checkpoint.py [--config configs/tiny-dense.yaml] [--rounds 5] [--set key=value ...]

One process trains the config (by default with a small batch, `SMALL_BATCH`, so that a step and a
save take seconds, not minutes, on a shared CPU; `--set` overrides it) on a small corpus (a few
standard-library modules, tokenized here); each round measures, one after the other, so that the
machine's load falls on all alike:

    no save       the median of `--steps` plain steps
    synchronous   one step and a synchronous save (the stall a periodic save costs today)
    background    one step and the start of a background save (the copy of the state to CPU),
                  then the steps trained while that save is written, until it is complete

Prints one JSON object: seconds of each (medians over rounds) and the ratios to a plain step, the
checkpoint's size and each round's ratios (`per_round`: the spread a shared machine gives).
`background_step_s` is what a step costs while the writer thread shares the CPU;
`background_extra_s` is what a whole background save adds to training (the copy plus the slow-down
of the steps it overlaps) next to `synchronous_extra_s`.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.config.schema import load_config  # noqa: E402
from tessera.data import default_tokenizer, preprocess  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402

SMALL_BATCH = ("train.seq_len=128", "train.micro_batch_size=2", "train.global_batch_size=2")
MODULES = ("json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "bisect.py", "heapq.py")


def build_small_dataset(directory: Path) -> str:
    """A few standard-library modules as a tokenized dataset (the bundled tokenizer)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = directory / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": (stdlib / f).read_text()}) + "\n" for f in MODULES))
    preprocess([docs], directory / "small", default_tokenizer(), show_progress=False)
    return str(directory / "small")


def _trainer(config: str, run_dir: Path, dataset: str, background: bool, overrides: list[str]) -> Trainer:
    sets = [f"run_dir={run_dir}", "train.device=cpu", "train.steps=100000", "train.eval_interval=0",
            "log.tensorboard=false", "log.progress_bar=false", "checkpoint.interval=0", "checkpoint.keep_last=2",
            f"checkpoint.async={str(background).lower()}", f"data.datasets=[{{path: {dataset}}}]",
            *SMALL_BATCH, *overrides]
    return Trainer(load_config(config, sets))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _round(plain: Trainer, sync: Trainer, background: Trainer, steps: int) -> dict[str, float]:
    out = {"no_save_s": statistics.median(_timed(plain.train_step) for _ in range(steps)),
           "synchronous_s": _timed(lambda: (sync.train_step(), sync.save()))}
    out["background_start_s"] = _timed(lambda: (background.train_step(), background.save()))
    overlapped = []
    while background.background.writing:
        overlapped.append(_timed(background.train_step))
    background.finish_save()
    out["background_step_s"] = statistics.mean(overlapped) if overlapped else float("nan")
    out["steps_during_background_save"] = len(overlapped)
    out["background_extra_s"] = (out["background_start_s"] - out["no_save_s"]
                                 + sum(t - out["no_save_s"] for t in overlapped))
    out["synchronous_extra_s"] = out["synchronous_s"] - out["no_save_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny-dense.yaml"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="plain steps per round")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tessera-bench-async-"))
    dataset = build_small_dataset(tmp)
    plain, sync, background = (_trainer(args.config, tmp / name, dataset, name == "background", args.overrides)
                               for name in ("plain", "sync", "background"))
    for t in (plain, sync, background):  # warm-up: the first step allocates optimizer state
        t.train_step()
    rounds = [_round(plain, sync, background, args.steps) for _ in range(args.rounds)]
    result = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    per_round = [{"synchronous": r["synchronous_s"] / r["no_save_s"], "background_start": r["background_start_s"]
                  / r["no_save_s"], "background_step": r["background_step_s"] / r["no_save_s"],
                  "extra_background_over_synchronous": r["background_extra_s"] / r["synchronous_extra_s"]}
                 for r in rounds]
    base = result["no_save_s"]
    result.update(synchronous_ratio=result["synchronous_s"] / base,
                  background_start_ratio=result["background_start_s"] / base,
                  background_step_ratio=result["background_step_s"] / base,
                  extra_ratio_background_over_synchronous=result["background_extra_s"] / result["synchronous_extra_s"])
    latest = sync.latest_checkpoint
    result["checkpoint_mib"] = sum(f.stat().st_size for f in latest.iterdir()) / 2**20
    result["per_round"] = [{k: round(v, 3) for k, v in r.items()} for r in per_round]
    result["machine"] = {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "python": platform.python_version(), "load_average": os.getloadavg()}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    main()
