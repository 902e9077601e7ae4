"""A student distilled from a larger teacher vs the same student alone, on the bundled corpus.

    python bench/distill.py [--teacher-steps 200] [--student-steps 150] [--distill 0.5:1 0.5:2 0.9:1:0.5 ...]

Three runs of one process on the bundled corpus (Python standard-library source, the bundled
tokenizer; prepared on first use under data.cache_dir):

    teacher     a larger model (TEACHER) trained `--teacher-steps` steps
    alone       the student (STUDENT) trained `--student-steps` steps on the data alone
    distilled   the same student, same seed, batches, steps and tokens, with train.distill.teacher
                set to the teacher's run, once per `--distill` weight:temperature pair; a third
                field adds hidden-state matching (train.distill.hidden_layers HIDDEN_LAYERS, with
                that train.distill.hidden_weight)

Each run ends with an evaluation on the same held-out validation batches (`--eval-steps`).
Prints one JSON object: each run's validation loss and wall time, the parameter counts, the tokens
the students saw and each distilled student's gain (the student alone's validation loss minus its).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.config.schema import load_config  # noqa: E402
from tessera.models.counting import count_params  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402

CONFIG = str(ROOT / "configs" / "tiny-dense.yaml")
COMMON = ("train.device=cpu", "train.seq_len=128", "train.micro_batch_size=8", "train.global_batch_size=8",
          "log.tensorboard=false", "log.progress_bar=false", "checkpoint.interval=0", "checkpoint.keep_last=1",
          "train.log_interval=50", "optim.lr=2e-3", "optim.min_lr=2e-4", "optim.warmup_steps=20")
TEACHER = ("model.dim=192", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=512")
# the student's 2 blocks matched to the teacher's second and last (of 4)
HIDDEN_LAYERS = "[[0, 1], [1, 3]]"
STUDENT = ("model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=192")


def run_config(run_dir: Path, steps: int, eval_steps: int, overrides: list[str]):
    """The bench's run of `steps` steps, evaluated on `eval_steps` held-out batches at its end."""
    return load_config(CONFIG, [*COMMON, f"run_dir={run_dir}", f"train.steps={steps}",
                                f"train.eval_interval={steps}", f"train.eval_steps={eval_steps}", *overrides])


def train(run_dir: Path, steps: int, eval_steps: int, overrides: list[str]) -> dict:
    """One run to `steps`, evaluated at its end; its validation loss, wall time, tokens and size."""
    cfg = run_config(run_dir, steps, eval_steps, overrides)
    start = time.perf_counter()
    result = Trainer(cfg).train()
    last = result.records[-1]
    out = {"val_loss": last["val_loss"], "wall_s": time.perf_counter() - start, "tokens": last["tokens_seen"],
           "params": count_params(cfg.model), "train_loss_last": last["loss"]}
    for key in ("distill_loss", "distill_hidden_loss"):
        if key in last:
            out[f"{key}_last"] = last[key]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher-steps", type=int, default=200)
    ap.add_argument("--student-steps", type=int, default=150)
    ap.add_argument("--distill", nargs="+", default=["0.5:1"], metavar="WEIGHT:TEMPERATURE[:HIDDEN_WEIGHT]",
                    help="one distilled student per train.distill.weight:temperature pair (a third field: "
                         "hidden-state matching of HIDDEN_LAYERS with that weight)")
    ap.add_argument("--eval-steps", type=int, default=8)
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        teacher = train(out / "teacher", args.teacher_steps, args.eval_steps, list(TEACHER))
        alone = train(out / "alone", args.student_steps, args.eval_steps, list(STUDENT))
        distilled = {}
        for pair in args.distill:
            weight, temperature, *hidden = pair.split(":")
            matching = ([f"train.distill.hidden_layers={HIDDEN_LAYERS}", f"train.distill.hidden_weight={hidden[0]}"]
                        if hidden else [])
            run = train(out / f"distilled-{pair.replace(':', '-')}", args.student_steps, args.eval_steps, [
                *STUDENT, f"train.distill.teacher={out / 'teacher'}", f"train.distill.weight={weight}",
                f"train.distill.temperature={temperature}", *matching])
            distilled[pair] = {**run, "val_loss_gain": alone["val_loss"] - run["val_loss"]}
    print(json.dumps({"machine": platform.machine(), "teacher": teacher, "alone": alone, "distilled": distilled,
                      "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
