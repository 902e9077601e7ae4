"""lm-evaluation-harness tasks on a Tessera model, offline.

    results = run_tasks(TesseraLM(llm=llm), ["tiny_mc"], include_path="tasks/", limit=100)
    # {"tiny_mc": {"acc": 0.61, "acc_norm": 0.58}}

Tasks are lm-eval's own and those defined by YAML files under `include_path` (lm-eval's
`TaskManager`): a local task names its data with `dataset_path: json` and `dataset_kwargs:
{data_files: ...}` (or any builder the `datasets` library runs on local files). Nothing is
downloaded: the HuggingFace hub is switched off for the whole process (HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE, `go_offline`), so a task whose data is neither local nor
already in the datasets cache fails, naming the task. Standard errors by bootstrap are not computed
(`bootstrap_iters=0`: lm-eval's bootstrap starts a process pool, which a trainer's process must not
fork); metrics come back as lm-eval aggregates them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from tessera.config.errors import ConfigError, EvaluationError

log = logging.getLogger("tessera.eval")

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def go_offline() -> None:
    """No download from the HuggingFace hub in this process: the environment variables for what
    imports later, and the constants `huggingface_hub` and `datasets` read them into when imported."""
    os.environ.update(OFFLINE)
    import datasets.config
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def task_manager(include_path: str | os.PathLike | None, names: list[str]):
    """lm-eval's TaskManager that knows `names`: the YAML files under `include_path` alone when they
    define every one of them (indexing lm-eval's own thousands of tasks takes tens of seconds),
    else those and lm-eval's own. A name neither knows is refused, naming the local tasks."""
    go_offline()
    from lm_eval.tasks import TaskManager

    local = None
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ConfigError(f"--include-path {str(include_path)!r} is not a directory of task YAML files")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(names) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [n for n in names if n not in set(manager.all_tasks)]
    if unknown:
        where = ("; define a local task with --include-path DIR (YAML + JSONL)" if local is None else
                 f"; the tasks of {include_path}: {', '.join(sorted(local.all_tasks)) or 'none'}")
        raise ConfigError(f"unknown task(s) {', '.join(unknown)}: not loss, humaneval, nor an lm-eval task{where}")
    return manager


def run_tasks(lm, names: list[str], include_path: str | os.PathLike | None = None, limit: int | None = None,
              num_fewshot: int | None = None, manager=None) -> dict[str, dict[str, float]]:
    """Evaluate lm-eval tasks `names` with `lm` (a `TesseraLM`); {task: {metric: value}}, groups
    included. `limit`: the first N documents of each task."""
    manager = manager or task_manager(include_path, names)
    import lm_eval

    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=list(names), task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=False)
    except (ConnectionError, FileNotFoundError, OSError) as e:
        raise EvaluationError(f"lm-eval task(s) {', '.join(names)} could not load their data offline ({e}); give "
                              "local data files in the task's YAML (dataset_path: json, dataset_kwargs.data_files)"
                              ) from e
    return {task: metric_values(values) for task, values in out["results"].items()}


def metric_values(values: dict[str, Any]) -> dict[str, float]:
    """lm-eval's `{"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": ...}` as `{"acc": 0.5}`: numbers
    only, the filter named only when it is not "none"."""
    out = {}
    for key, value in values.items():
        if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric, filt = key.split(",", 1)
        out[metric if filt == "none" else f"{metric},{filt}"] = float(value)
    return out
