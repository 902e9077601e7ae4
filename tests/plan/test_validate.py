"""`tessera plan validate`: the time model against published training runs, one set of constants
per GPU type, every run within 20% of its published figure."""

from __future__ import annotations

import json

import pytest

from tessera.cli import main as tessera_main
from tessera.plan.published import published_runs
from tessera.plan.validate import validation_rows


def main(argv: list[str]) -> int:
    """`tessera plan ARGV`."""
    return tessera_main(["plan", *argv])


def test_every_published_run_is_predicted_within_20_percent():
    rows = validation_rows()
    names = [r["name"] for r in rows]
    assert sum("Megatron-LM" in n for n in names) == 8  # 22B, 175B, 530B, 1T x (selective, full recompute)
    assert sum("Llama 3 405B" in n for n in names) == 2 and sum("DeepSeek-V3" in n for n in names) == 1
    for r in rows:
        assert r["relative_error"] == pytest.approx(r["predicted"] / r["published"] - 1)
        assert abs(r["relative_error"]) < 0.20, r
    # The model must also order the runs the way the papers do, not only land near each figure.
    by_name = {r["name"]: r for r in rows}
    for size in ("22B", "175B", "530B", "1T"):
        sel, full = (next(r for n, r in by_name.items() if f"GPT {size}," in n and label in n)
                     for label in ("selective", "full"))
        assert full["predicted"] > 1.1 * sel["predicted"]  # full recomputation costs more than selective
    llama = [r for r in rows if "Llama 3" in r["name"]]
    assert llama[0]["predicted"] > llama[1]["predicted"]  # fewer micro-batches per pipeline at 16K GPUs


def test_runs_record_source_hardware_layout_and_batch():
    for run in published_runs():
        assert "arXiv" in run.source and run.gpu in ("a100", "h100", "h800")
        assert run.layout.world == run.gpus and run.work.tokens > 0 and run.figure > 0


def test_validate_command_prints_a_table_and_json(capsys):
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    assert "published" in out and "Largest error" in out and "Korthikanti" in out
    assert main(["validate", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list) and len(rows) == len(published_runs())
    for r in rows:
        assert {"name", "published", "predicted", "relative_error"} <= set(r)
        assert isinstance(r["published"], float) and isinstance(r["relative_error"], float)
