"""`tessera train` prints one text line per logged step on stdout (step, loss, lr, grad norm,
tokens/s, elapsed), Megatron-style, when no progress bar shows the run: the bar is off, or the
console is not a terminal (a log file, a batch job); on a terminal with the bar on it does not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tessera.train.run.console import step_line, wants_step_lines
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT, TINY_MOE, moe_shrink, set_args

LINE = re.compile(r"^step (\d+)/4 \| loss (\d+\.\d{4}) \| lr \d\.\d\de-\d\d \| grad norm \d+\.\d{4} \| "
                  r"tokens/s [\d,]+ \| elapsed \d+:\d\d:\d\d$", re.M)


def test_train_into_a_pipe_prints_a_line_per_logged_step(small_dataset, tmp_path):
    run = tmp_path / "run"
    overrides = moe_shrink(small_dataset, run, 4, **{"train.log_interval": 2, "log.progress_bar": True})
    done = subprocess.run([sys.executable, "-m", "tessera", "train", TINY_MOE, *set_args(overrides)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = LINE.findall(done.stdout)
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [int(s) for s, _ in lines] == [r["step"] for r in logged] == [1, 2, 4]
    assert [float(loss) for _, loss in lines] == [round(r["loss"], 4) for r in logged]


def test_lines_only_where_no_bar_shows_the_run(tmp_path):
    main_fd, other_fd = os.openpty()
    with os.fdopen(other_fd, "w") as terminal, open(tmp_path / "log", "w") as log_file:
        assert terminal.isatty() and not wants_step_lines(True, terminal)
        assert wants_step_lines(False, terminal)  # the bar is off
        assert wants_step_lines(True, log_file)
    os.close(main_fd)


def test_a_record_without_some_figures_still_gives_a_line():
    line = step_line({"step": 7, "loss": 1.5, "skipped_step": True}, 10, 3725.2)
    assert line == "step 7/10 | loss 1.5000 | skipped (gradient not finite) | elapsed 1:02:05"
