"""`tessera train --profile A:B` and `tessera profile RUN_DIR` name causes planted on real gloo ranks:
a rank slowed on purpose is the straggler with its lag, a data loader stalled on purpose shows as data
wait, the collectives of one process group delayed on purpose show as that group's exposed
communication (and as the largest difference from the plan), a pipeline with too few micro-batches
shows the bubble the planner predicts; the report's files are a parsable HTML
page, a PNG of the picture's size and JSON of the contract, holding no path of the machine but the run
directory's. The plants are sleeps put around the real parts (the step engine, the data pipeline, the
function that issues a timed collective); the expected figures are those sleeps."""

from __future__ import annotations

import json
import statistics
import struct
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config.schema import load_config
from tessera.profiling.picture import scene
from tessera.profiling.training import analyse, read_profile
from tessera.train.run import profile_record
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import TINY_DENSE
from tests.train.runs import shrink

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WINDOW = (2, 4)  # step 1 warms up; the run's last step (5) saves a checkpoint, outside the window
STRAGGLER_S = 1.0  # rank 1's extra work per step (large against the noise of a shared CPU's ranks)
DATA_STALL_S = 0.2  # every rank's wait for its batch
COMM_DELAY_S = 0.03  # each dp collective's delay


def _slowed(fn, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def _straggler_and_stalled_data(overrides: list[str]) -> None:
    import torch.distributed as dist

    trainer = Trainer(load_config(TINY_DENSE, overrides), profile=WINDOW)
    trainer.data.train.next_batch = _slowed(trainer.data.train.next_batch, DATA_STALL_S)
    if dist.get_rank() == 1:
        trainer.engine.forward_backward = _slowed(trainer.engine.forward_backward, STRAGGLER_S)
    trainer.train()


def _delayed_dp_collectives(overrides: list[str]) -> None:
    issue = profile_record.run_collective

    def delayed(func, args, kwargs, group, wait):
        if group == "dp":
            time.sleep(COMM_DELAY_S)
        return issue(func, args, kwargs, group, wait)

    profile_record.run_collective = delayed  # this forked rank's module only
    Trainer(load_config(TINY_DENSE, overrides), profile=WINDOW).train()


def test_a_slowed_rank_is_the_straggler_and_a_stalled_loader_is_data_wait(small_dataset, tmp_path):
    run_dir = tmp_path / "run"
    run_ranks(_straggler_and_stalled_data, 2, shrink(small_dataset, run_dir, 5, **{"parallel.dp_shard": 2,
                                                                                    "checkpoint.interval": 0}),
              timeout=120)
    report = analyse(run_dir, plan=False)
    assert report["steps"] == [2, 3, 4]
    s = report["straggler"]
    assert s["rank"] == 1 and s["named"]
    assert s["lag_s"] == pytest.approx(STRAGGLER_S, rel=0.2)
    for rank in ("0", "1"):
        assert report["ranks"][rank]["terms"]["data_wait"] == pytest.approx(DATA_STALL_S, rel=0.2)
    # rank 0 waits for rank 1 in the step's first collectives: its exposed communication holds the lag
    assert report["ranks"]["0"]["terms"]["exposed_comm/dp"] >= 0.8 * STRAGGLER_S


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_delayed_dp_collectives_are_exposed_dp_communication_and_the_report_renders(small_dataset, tmp_path,
                                                                                      capsys):
    run_dir = tmp_path / "run"
    overrides = shrink(small_dataset, run_dir, 5, **{"parallel.dp_shard": 2, "parallel.tp": 2,
                                                     "checkpoint.interval": 0})
    run_ranks(_delayed_dp_collectives, 4, overrides, timeout=180)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["profile", str(run_dir), "--json", str(out / "r.json"), "--html", str(out / "r.html"),
                 "--png", str(out / "r.png")]) == 0
    report = json.loads((out / "r.json").read_text())
    assert set(report) >= {"steps", "ranks", "terms", "straggler"} and set(report["ranks"]) == {"0", "1", "2", "3"}
    terms = report["terms"]
    assert {"compute", "exposed_comm/dp", "exposed_comm/tp", "pipeline_bubble", "data_wait", "optimizer",
            "idle"} <= set(terms)
    assert all(set(v) == {"measured_s", "planned_s"} for v in terms.values())
    # every dp collective of a step waited COMM_DELAY_S more, on every rank
    dp_calls = sum(1 for e in read_profile(run_dir)[0]["events"] if e.get("group") == "dp") / len(report["steps"])
    assert dp_calls >= 2
    assert terms["exposed_comm/dp"]["measured_s"] >= 0.9 * dp_calls * COMM_DELAY_S
    assert terms["exposed_comm/tp"]["measured_s"] < terms["exposed_comm/dp"]["measured_s"]
    assert report["differences"][0]["term"] == "exposed_comm/dp"
    assert any(k.startswith("dp/all_gather") for k in report["ranks"]["0"]["comm_by_kind"])  # FSDP's gathers
    assert "exposed_comm/dp" in capsys.readouterr().out

    page = (out / "r.html").read_text()
    parser = _Tags()
    parser.feed(page)
    assert {"html", "svg", "rect", "table"} <= set(parser.tags)
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page
    picture = scene(analyse(run_dir, plan=False), read_profile(run_dir))
    assert _png_size(out / "r.png") == (picture.width, picture.height)
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1, 2, 3}
    for text in (page, (out / "r.json").read_text(), json.dumps(trace)):
        for root in ("/home/", "/usr/", "/work/", str(Path.cwd()), str(Path(__file__).parents[2])):
            assert root not in text


def _profiled_long(overrides: list[str]) -> None:
    Trainer(load_config(TINY_DENSE, overrides), profile=(2, 6)).train()


def test_a_pipeline_with_too_few_micro_batches_shows_the_bubble_the_plan_predicts(small_dataset, tmp_path):
    """2 stages, 2 micro-batches, GPipe: the planner's bubble is (p - 1) / m = half the slowest stage's
    compute; the stages' waits for each other (their time outside their micro-batches' forward and
    backward, their sends and receives on the pp group) average to it within 20%. The model is larger
    than elsewhere so that compute, not the schedule's host work, sets the stages' pace."""
    bigger = {"model.dim": 256, "model.ffn_dim": 512, "model.n_heads": 8, "model.n_kv_heads": 4,
              "model.max_seq_len": 128, "train.seq_len": 128}
    layout = {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "checkpoint.interval": 0}
    medians = []
    for attempt in range(3):  # a measured share: a run a busy machine stretched unevenly is run again
        run_dir = tmp_path / f"run{attempt}"
        run_ranks(_profiled_long, 2, shrink(small_dataset, run_dir, 7, **layout, **bigger), timeout=300)
        report = analyse(run_dir)
        assert report["sizes"]["pp"] == 2 and report["steps"] == [2, 3, 4, 5, 6]
        assert any(k.startswith("pp/send_recv") for r in report["ranks"].values() for k in r["comm_by_kind"])
        assert {"forward", "backward"} <= set(report["ranks"]["0"]["compute_by_phase"])  # the stages' chunks, marked
        assert {"attention", "mlp", "norm"} <= set(report["ranks"]["1"]["compute_by_kind"])  # modules, hooked
        terms = report["terms"]
        planned_share = terms["pipeline_bubble"]["planned_s"] / terms["compute"]["planned_s"]  # the slowest stage's
        assert planned_share == pytest.approx(0.5, rel=0.05)
        # each step's bubble (averaged over the stages) against its slowest stage's compute; the median step,
        # so that a step another job on the machine stretched does not decide
        steps = [[r["steps"][str(s)]["terms"] for r in report["ranks"].values()] for s in report["steps"]]
        shares = [statistics.mean(t["pipeline_bubble"] for t in step) / max(t["compute"] for t in step)
                  for step in steps]
        medians.append(statistics.median(shares))
        if medians[-1] == pytest.approx(planned_share, rel=0.2):
            break
    assert medians[-1] == pytest.approx(planned_share, rel=0.2), medians
    assert terms["pipeline_bubble"]["measured_s"] > 0
