"""`tessera plan validate`: the planner against published training runs, one set of constants per
GPU type: the calibration runs' times within 20% of their published figures, the held-out runs'
memory within 25%, and DeepSeek-V3 fitting the GPUs it ran on."""

from __future__ import annotations

import json

import pytest

from tessera.cli import main as tessera_main
from tessera.plan.gpus import GPUS
from tessera.plan.published import plan_run, published_runs
from tessera.plan.validate import validation_rows


def main(argv: list[str]) -> int:
    """`tessera plan ARGV`."""
    return tessera_main(["plan", *argv])


def test_every_calibration_run_is_predicted_within_20_percent():
    rows = validation_rows()
    names = [r["name"] for r in rows]
    assert sum("Megatron-LM" in n for n in names) == 8  # 22B, 175B, 530B, 1T x (selective, full recompute)
    assert sum("Llama 3 405B" in n for n in names) == 2 and sum("DeepSeek-V3" in n for n in names) == 1
    calibration = [r for r in rows if not r["held_out"]]
    assert len(calibration) == 11 and all("torchtitan" not in r["name"] for r in calibration)
    for r in rows:
        if r["time_not_compared"] is None:
            assert r["relative_error"] == pytest.approx(r["predicted"] / r["published"] - 1)
        else:  # Float8 runs: the time model prices bf16 GEMMs, so their time is not compared
            assert r["relative_error"] is None and r["held_out"] and "Float8" in r["time_not_compared"]
    for r in calibration:
        assert r["time_not_compared"] is None
        assert abs(r["relative_error"]) < 0.20, r
    # The model must also order the runs the way the papers do, not only land near each figure.
    by_name = {r["name"]: r for r in rows}
    for size in ("22B", "175B", "530B", "1T"):
        sel, full = (next(r for n, r in by_name.items() if f"GPT {size}," in n and label in n)
                     for label in ("selective", "full"))
        assert full["predicted"] > 1.1 * sel["predicted"]  # full recomputation costs more than selective
    llama = [r for r in rows if "Llama 3" in r["name"]]
    assert llama[0]["predicted"] > llama[1]["predicted"]  # fewer micro-batches per pipeline at 16K GPUs


def test_held_out_runs_memory_within_25_percent_of_what_they_reported():
    """torchtitan's Llama 3.1 8B runs (FSDP, operator-level selective checkpointing, sequence 8192)
    were planned at about twice the GPU's memory before the planner modelled that policy; nothing
    was fitted to them. Their memory (the allocator's peak reservation) is within 25%, and so is
    that of the same report's 8B runs with context parallelism and full checkpointing at 32K-256K
    and of its 70B runs (FSDP 32 x TP 8), once the loss is torch's as torchtitan runs it."""
    held_out = [r for r in validation_rows() if r["held_out"]]
    assert len(held_out) == 10 and all("torchtitan" in r["name"] for r in held_out)
    op_policy = [r for r in held_out if "Llama 3.1 8B" in r["name"] and "CP" not in r["name"]]
    context_parallel = [r for r in held_out if "CP" in r["name"]]
    assert len(op_policy) == 4 and all("recompute=op" in r["layout"] for r in op_policy)
    assert len(context_parallel) == 4 and all("recompute=full" in r["layout"] for r in context_parallel)
    for r in held_out:
        m = r["memory"]
        assert abs(m["relative_error"]) < 0.25, (r["name"], m)


def test_a_peak_the_source_gives_as_a_range_brackets_the_time_error():
    """torchtitan's H100s run at 500 W, their peak "between SXM and NVL": the prediction is made at
    both ends, and the lower peak predicts less throughput (a smaller error, as they are over)."""
    timed = [r for r in validation_rows() if r["held_out"] and r["relative_error"] is not None]
    assert len(timed) == 4
    for r in timed:
        assert r["relative_error"] > r["lowest_peak_relative_error"] > -1, r["name"]
    others = [r for r in validation_rows() if not r["held_out"] or r["relative_error"] is None]
    assert all(r["lowest_peak_relative_error"] is None for r in others)


def test_held_out_time_within_25_percent_at_the_lowest_peak_the_source_allows():
    """Priced with the kernels torchtitan runs (torch's SDPA, and its elementwise work unfused
    without torch.compile), the held-out times are within 25% at the NVL's peak, the lower end of
    the source's range; at the SXM's they are over by about a third (docs/planning.md's validate output shows both)."""
    timed = [r for r in validation_rows() if r["held_out"] and r["relative_error"] is not None]
    assert len(timed) == 4
    for r in timed:
        assert 0 < r["lowest_peak_relative_error"] < 0.25, r["name"]
        assert r["profile"] == ("tessera" if "compile" in r["name"] else "torch-eager"), r["name"]


def test_torchtitan_runs_take_torchs_loss():
    runs = [r for r in published_runs() if "torchtitan" in r.source]
    assert len(runs) == 10 and all(r.loss == "torch" for r in runs)
    assert all(r.loss == "tessera" for r in published_runs() if "torchtitan" not in r.source)


def test_every_held_out_run_fits_where_it_ran_and_under_the_reported_reservation():
    """Every held-out run fits the GPUs it ran on, and no plan exceeds the published figure: the
    planner counts tensors, the published figure is the caching allocator's peak reservation,
    which holds them."""
    for r in (r for r in validation_rows() if r["held_out"]):
        m = r["memory"]
        assert m["fits"] and m["predicted_gib"] <= m["ran_on_gib"], (r["name"], m)
        assert -0.5 < m["relative_error"] < 0, (r["name"], m)


def test_deepseek_v3_plans_as_fitting_the_80_gb_h800s_it_ran_on():
    """With the report's memory policies (recomputed RMSNorm and MLA up-projections, SwiGLU inputs in
    FP8, BF16 moments, ZeRO-1) the run fits an 80 GB H800; without them it does not."""
    run = next(r for r in published_runs() if "DeepSeek-V3" in r.name)
    with_policies = plan_run(run, memory=True)
    assert with_policies.cluster.gpu_memory == 80 * 2**30 and with_policies.fits
    without = plan_run(run)  # the time layout: no recomputation
    assert not without.fits and without.peak.total > 1.3 * with_policies.peak.total


def test_runs_record_source_hardware_layout_and_batch():
    for run in published_runs():
        assert ("arXiv" in run.source or "pytorch/torchtitan" in run.source) and run.gpu in GPUS
        assert run.layout.world == run.gpus and run.work.tokens > 0 and run.figure > 0
        assert run.memory_gib is None or run.held_out  # published memory figures: the held-out runs'


def test_validate_command_prints_time_and_memory_and_the_held_out_errors(capsys):
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    assert "published" in out and "Korthikanti" in out and "torchtitan" in out
    assert "Memory per GPU" in out and "held out" in out and "calibration" in out
    assert "Held-out runs: largest time error" in out and "largest memory error" in out
    assert main(["validate", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list) and len(rows) == len(published_runs())
    for r in rows:
        assert {"name", "published", "predicted", "relative_error", "held_out", "memory"} <= set(r)
        assert isinstance(r["published"], float)
        assert isinstance(r["relative_error"], float) or r["time_not_compared"]
        assert {"predicted_gib", "ran_on_gib", "fits", "relative_error"} <= set(r["memory"])
