"""The Minitron recipe on the bundled corpus: train a teacher, prune it, distill it back.

    python bench/prune_distill.py [--teacher-steps 400] [--prune-fraction 0.34] [--student-steps 300]
                                  [--distill 0.9:1]

One process on the bundled corpus, the runs of bench/distill.py (same batches, schedule, evaluation):

    teacher     bench/distill.py's TEACHER trained `--teacher-steps` steps, exported with
                `tessera convert` to a HuggingFace directory
    pruned      `tessera prune` of that directory to `--target-params` = (1 - `--prune-fraction`) x
                the teacher's parameters, evaluated as it is (no training)
    plain       the pruned model trained `--student-steps` steps from its pruned weights
                (train.init_from) on the data alone
    distilled   the same, same seed, batches, steps and tokens, with train.distill.teacher set to the
                teacher's run (train.distill.weight:temperature from `--distill`)

Prints one JSON object: each validation loss (the same held-out batches), the parameter counts, the
wall times and the fraction of the gap between the pruned model's loss and the teacher's that each
trained student recovered: (pruned - student) / (pruned - teacher).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from distill import TEACHER, run_config, train  # noqa: E402

from tessera.cli import main as tessera  # noqa: E402
from tessera.models.counting import count_params  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402


def command(*args: str) -> str:
    """A `tessera` command run in this process; its standard output (what prune chose)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = tessera(list(args))
    if status != 0:
        raise SystemExit(f"tessera {' '.join(args)}: exit {status}")
    return out.getvalue()


def from_hf(directory: Path) -> list[str]:
    """Overrides that start a run from a HuggingFace directory's model and weights."""
    return ["model=null", f"train.init_from={directory}"]


def evaluate(run_dir: Path, eval_steps: int, overrides: list[str]) -> dict:
    """The validation loss of a run's starting weights, before any step."""
    cfg = run_config(run_dir, 1, eval_steps, overrides)
    return {"val_loss": Trainer(cfg).evaluate()["val_loss"], "params": count_params(cfg.model)}


def recovered(pruned: float, teacher: float, student: float) -> float:
    return (pruned - student) / (pruned - teacher)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher-steps", type=int, default=400)
    ap.add_argument("--prune-fraction", type=float, default=0.34, help="the share of parameters to remove")
    ap.add_argument("--student-steps", type=int, default=300)
    ap.add_argument("--distill", default="0.9:1", metavar="WEIGHT:TEMPERATURE")
    ap.add_argument("--eval-steps", type=int, default=8)
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args()
    weight, temperature = args.distill.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        teacher = train(out / "teacher", args.teacher_steps, args.eval_steps, list(TEACHER))
        command("convert", str(out / "teacher"), str(out / "teacher-hf"))
        target = int(teacher["params"] * (1 - args.prune_fraction))
        chose = command("prune", str(out / "teacher-hf"), str(out / "pruned"), "--target-params", str(target))
        start = from_hf(out / "pruned")
        teacher_hf = evaluate(out / "teacher-hf-eval", args.eval_steps, from_hf(out / "teacher-hf"))
        pruned = evaluate(out / "pruned-eval", args.eval_steps, start)
        plain = train(out / "plain", args.student_steps, args.eval_steps, start)
        distilled = train(out / "distilled", args.student_steps, args.eval_steps, [
            *start, f"train.distill.teacher={out / 'teacher'}", f"train.distill.weight={weight}",
            f"train.distill.temperature={temperature}"])
    gap = {name: recovered(pruned["val_loss"], teacher["val_loss"], run["val_loss"])
           for name, run in (("plain", plain), ("distilled", distilled))}
    print(json.dumps({"machine": platform.machine(), "teacher": teacher, "teacher_hf": teacher_hf,
                      "prune": {"target_params": target, "printed": chose.strip()}, "pruned": pruned,
                      "plain": plain, "distilled": distilled, "gap_recovered": gap, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
