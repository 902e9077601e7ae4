"""`tessera train ... --profile A:B` records exactly steps A..B (in one process, and on every rank that
`--nproc` starts), a bad window is refused before training with exit 2, markers outside the window
are the shared null context, and `tessera profile RUN_DIR` reports the steps with the planner's terms
beside them; a directory with no profile is refused by name."""

from __future__ import annotations

import json

import pytest

from tessera.cli import main
from tessera.config.errors import ConfigError
from tessera.train.run import profile_record
from tessera.train.run.profile_record import mark, parse_window
from tests.train.runs import TINY_DENSE, set_args, shrink


@pytest.mark.parametrize("text", ["5:2", "0:3", "3", "a:b", "2:"])
def test_a_bad_window_is_refused_by_its_text(text):
    with pytest.raises(ConfigError, match=rf"--profile '{text}' is invalid: A:B with 1 <= A <= B"):
        parse_window(text)


def test_a_bad_window_stops_the_command_with_status_2(capsys):
    assert main(["train", TINY_DENSE, "--profile", "4:1"]) == 2
    assert "--profile '4:1' is invalid" in capsys.readouterr().err


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_process_records_the_window_and_profile_reports_it(small_dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, run, 3, **{"checkpoint.interval": 0})),
                 "--profile", "2:2"]) == 0
    assert mark("compute") is profile_record._NULL and not profile_record.profiling()  # outside: a no-op
    lines = _lines(run / "profile" / "rank0.jsonl")
    assert lines[0]["meta"]["window"] == [2, 2] and lines[0]["meta"]["world"] == 1
    assert {line["step"] for line in lines[1:]} == {2}
    kinds = {line["kind"] for line in lines[1:]}
    assert {"step", "data", "region", "compute", "optimizer"} <= kinds and "comm" not in kinds
    assert {(line["name"], line["microbatch"]) for line in lines[1:] if line["kind"] == "compute"} == {
        ("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)}
    capsys.readouterr()
    assert main(["profile", str(run), "--json", str(tmp_path / "r.json")]) == 0
    assert "steps 2..2 on 1 rank(s)" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["steps"] == [2] and report["straggler"]["rank"] is None
    compute = report["terms"]["compute"]
    assert compute["measured_s"] > 0 and compute["planned_s"] == pytest.approx(compute["measured_s"], rel=0.05)
    assert report["terms"]["data_wait"]["planned_s"] == 0.0 and report["planned"]["hardware"].startswith("h100")


def test_a_directory_without_a_profile_is_refused(tmp_path, capsys):
    assert main(["profile", str(tmp_path)]) == 2
    assert "holds no profile/rank*.jsonl" in capsys.readouterr().err


@pytest.mark.dist
def test_nproc_passes_the_window_to_every_rank(small_dataset, tmp_path):
    run = tmp_path / "run"
    overrides = shrink(small_dataset, run, 2, **{"parallel.dp_shard": 2, "checkpoint.interval": 0})
    assert main(["train", TINY_DENSE, *set_args(overrides), "--nproc", "2", "--profile", "1:1"]) == 0
    for rank in (0, 1):
        lines = _lines(run / "profile" / f"rank{rank}.jsonl")
        assert lines[0]["meta"]["rank"] == rank
        assert {line.get("group") for line in lines[1:] if line["kind"] == "comm"} == {"dp"}
