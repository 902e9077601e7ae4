"""`tessera eval --output PATH` is checked before the evaluation starts: a place that cannot be
written is one line and exit status 2 at once, not a traceback after the whole evaluation. The
model below does not exist, so the refusal proves the output was checked first."""

from __future__ import annotations

import os

import pytest

from tessera.cli import main
from tessera.config.errors import EvaluationError
from tessera.eval.report import EvalReport, check_output, write_output


def _refused(capsys, output: str, why: str) -> None:
    assert main(["eval", "/nonexistent/model", "--tasks", "loss", "--output", output]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera eval: error: --output") and why in lines[0], lines


def test_an_unwritable_output_is_refused_before_the_evaluation(tmp_path, capsys):
    _refused(capsys, "/proc/tessera-results.json", "cannot be written")  # unwritable even for root
    _refused(capsys, "/proc/tessera/results.json", "cannot be written")  # its directories cannot be made
    _refused(capsys, str(tmp_path), "is a directory")
    (tmp_path / "file").write_text("")
    _refused(capsys, str(tmp_path / "file" / "results.json"), "is not a directory")
    os.mkfifo(tmp_path / "fifo")
    _refused(capsys, str(tmp_path / "fifo"), "not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file"]


def test_a_writable_output_passes_the_check_and_leaves_nothing(tmp_path):
    check_output(tmp_path / "new" / "dirs" / "results.json")
    check_output(tmp_path / "results.json")
    (tmp_path / "old.json").write_text("{}")
    check_output(tmp_path / "old.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    write_output(EvalReport("m", ["loss"], {"loss": {"loss": 1.0}}), tmp_path / "new" / "results.json")
    assert '"loss": 1.0' in (tmp_path / "new" / "results.json").read_text()


def test_a_write_that_fails_after_the_evaluation_is_one_line():
    with pytest.raises(EvaluationError, match="could not be written.*in the table above"):
        write_output(EvalReport("m", ["loss"]), "/proc/tessera-results.json")
