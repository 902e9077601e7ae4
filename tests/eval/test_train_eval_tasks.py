"""`train.eval_tasks`: chosen tasks run at each evaluation of a run, on the model of that step, and
their metrics go to metrics.jsonl and TensorBoard; the last evaluation's numbers equal `tessera eval`
of the final checkpoint; under ranks (FSDP shards, pipeline stages) rank 0 evaluates the whole model
gathered from them; unknown tasks and tasks without evaluations are refused before training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from tessera.cli import main  # noqa: E402
from tessera.config.errors import ConfigError  # noqa: E402
from tessera.config.schema import load_config  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402
from tests.train.runs import TINY_DENSE, set_args, shrink  # noqa: E402

TASK_KEYS = ("tiny_mc/acc", "tiny_mc/acc_norm")


def _overrides(dataset: str, run: Path, tasks_dir: Path, **extra) -> list[str]:
    return shrink(dataset, run, 4, **{"train.eval_interval": 2, "train.eval_steps": 1, "data.valid_fraction": 0.1,
                                      "train.eval_tasks": "[tiny_mc]", "train.eval_tasks_path": str(tasks_dir),
                                      **extra})


def _task_records(run: Path) -> dict[int, dict[str, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: r[k] for k in TASK_KEYS} for r in records if "val_loss" in r}


def test_tasks_run_at_each_evaluation_and_are_logged(small_dataset, local_tasks, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(_overrides(small_dataset, run, local_tasks,
                                                           **{"log.tensorboard": True}))]) == 0
    logged = _task_records(run)
    assert sorted(logged) == [2, 4] and all(0.0 <= v <= 1.0 for r in logged.values() for v in r.values())
    assert "step 4: tiny_mc/acc" in capsys.readouterr().err

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("tiny_mc/acc")] == [2, 4]
    assert events.Scalars("tiny_mc/acc")[-1].value == pytest.approx(logged[4]["tiny_mc/acc"])

    out = tmp_path / "final.json"  # the final checkpoint is the model of step 4
    assert main(["eval", str(run), "--tasks", "tiny_mc", "--include-path", str(local_tasks),
                 "--output", str(out)]) == 0
    final = json.loads(out.read_text())["results"]["tiny_mc"]
    assert {f"tiny_mc/{k}": v for k, v in final.items()} == logged[4]


def test_unknown_tasks_and_tasks_without_evaluations_are_refused_before_training(small_dataset, local_tasks,
                                                                                  tmp_path, capsys):
    run = tmp_path / "run"
    bad = _overrides(small_dataset, run, local_tasks, **{"train.eval_tasks": "[tiny_mc, no_such_task]"})
    assert main(["train", TINY_DENSE, *set_args(bad)]) == 2
    assert "no_such_task" in capsys.readouterr().err and not (run / "checkpoints").exists()
    never = _overrides(small_dataset, run, local_tasks, **{"train.eval_interval": 0})
    assert main(["train", TINY_DENSE, *set_args(never)]) == 2
    assert "train.eval_interval > 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="needs an evaluator"):
        Trainer(load_config(TINY_DENSE, _overrides(small_dataset, run, local_tasks)))


@pytest.fixture(scope="module")
def one_process_records(small_dataset, local_tasks, tmp_path_factory) -> dict[int, dict[str, float]]:
    """The task metrics of the same run in one process: every layout below is compared with this one
    run, so it is trained once per module instead of once per layout (its overrides name no layout).
    `datasets` caches under this fixture's own directory, as the autouse fixture does for a test."""
    import datasets.config

    base = tmp_path_factory.mktemp("one_process")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", base / "hf_datasets")
        assert main(["train", TINY_DENSE, *set_args(_overrides(small_dataset, base / "one", local_tasks))]) == 0
    return _task_records(base / "one")


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.pp=2", "parallel.dp_shard=1"]],
                         ids=["fsdp2", "pp2"])
def test_ranks_evaluate_the_whole_model_gathered_on_rank_0(small_dataset, local_tasks, one_process_records,
                                                           tmp_path, layout):
    ranks = tmp_path / "ranks"
    overrides = _overrides(small_dataset, ranks, local_tasks) + layout
    assert main(["train", TINY_DENSE, "--nproc", "2", *set_args(overrides)]) == 0
    expected, got = one_process_records, _task_records(ranks)
    assert sorted(got) == [2, 4]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-9)
