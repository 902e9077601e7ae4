"""One evaluation of one model over a list of tasks: what `tessera eval` and `train.eval_tasks` run.

    report = evaluate("runs/tiny-dense", ["loss", "tiny_mc", "humaneval"],
                      EvalSettings(include_path="tasks/", limit=50))
    print(report.table())

Task names: `loss` (held-out loss and perplexity, `tessera.eval.loss`), `humaneval` (pass@k,
`tessera.eval.humaneval`) and any lm-eval task, its own or one defined under `include_path`
(`tessera.eval.harness`). What can be refused is refused before a model is loaded: an unknown task,
a sandbox that cannot run (HumanEval without `allow_unsandboxed`). The loss runs on the trainer's
builder; the other tasks share one serving engine (`LLM`), built once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tessera.config.errors import ConfigError
from tessera.eval.humaneval import HumanEvalConfig, evaluate_humaneval
from tessera.eval.report import EvalReport
from tessera.eval.sandbox import Sandbox, SandboxLimits

LOSS, HUMANEVAL = "loss", "humaneval"


@dataclass
class EvalSettings:
    data: str | None = None  # loss: a dataset prefix or text / JSONL (None: a run's validation split)
    include_path: str | None = None  # a directory of local lm-eval task YAML files
    limit: int | None = None  # per task: lm-eval documents, HumanEval problems, loss global batches
    num_fewshot: int | None = None  # lm-eval: few-shot examples (None: each task's own)
    overrides: list[str] = field(default_factory=list)  # loss: run-config `--set` overrides
    keep_layout: bool = False  # loss: keep the checkpoint's parallel layout (on ranks)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields of the serving engine
    humaneval: HumanEvalConfig = field(default_factory=HumanEvalConfig)
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    allow_unsandboxed: bool = False  # run generated code with rlimits only where namespaces are unavailable

    def __post_init__(self) -> None:
        if self.limit is not None and not (isinstance(self.limit, int) and self.limit >= 1):
            raise ConfigError(f"limit={self.limit!r} is invalid: must be None or an integer >= 1")
        if self.num_fewshot is not None and not (isinstance(self.num_fewshot, int) and self.num_fewshot >= 0):
            raise ConfigError(f"num_fewshot={self.num_fewshot!r} is invalid: must be None or an integer >= 0")


def parse_tasks(text: str | list[str]) -> list[str]:
    """`"loss,tiny_mc"` (or a list) -> ["loss", "tiny_mc"]: non-empty names, each once."""
    names = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
    if not names or not all(names):
        raise ConfigError(f"tasks {text!r} is invalid: give comma-separated task names (loss, humaneval, or lm-eval "
                          "task names)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"tasks {text!r} names {', '.join(repeated)} more than once")
    return names


def lm_eval_names(tasks: list[str]) -> list[str]:
    return [t for t in tasks if t not in (LOSS, HUMANEVAL)]


class TaskRunner:
    """The checks done before a model is loaded, then the generation tasks on a given `LLM`."""

    def __init__(self, tasks: list[str], settings: EvalSettings):
        self.tasks, self.settings = tasks, settings
        self.manager = None
        if lm_eval_names(tasks):
            from tessera.eval.harness import task_manager

            self.manager = task_manager(settings.include_path, lm_eval_names(tasks))
        self.sandbox = None
        if HUMANEVAL in tasks:
            self.sandbox = Sandbox(settings.sandbox, settings.allow_unsandboxed)
            self.sandbox.check()

    def on_llm(self, llm) -> dict[str, dict[str, float]]:
        """The lm-eval tasks and HumanEval with the engine of `llm`."""
        s, results = self.settings, {}
        names = lm_eval_names(self.tasks)
        if names:
            from tessera.eval.harness import run_tasks
            from tessera.eval.lm_eval_model import TesseraLM

            results.update(run_tasks(TesseraLM(llm=llm), names, s.include_path, s.limit, s.num_fewshot,
                                     self.manager))
        if self.sandbox is not None:
            results[HUMANEVAL] = evaluate_humaneval(llm, self.sandbox, s.humaneval, s.limit)
        return results


def evaluate(model: str, tasks: list[str], settings: EvalSettings | None = None) -> EvalReport:
    """Every task on `model` (a run, a checkpoint, a HuggingFace or pre-quantized directory)."""
    settings = settings or EvalSettings()
    start = time.perf_counter()
    runner = TaskRunner(tasks, settings)
    results: dict[str, dict[str, float]] = {}
    if LOSS in tasks:
        from tessera.eval.loss import evaluate_loss

        results[LOSS] = evaluate_loss(model, settings.data, settings.limit, settings.overrides, settings.keep_layout)
    if any(t != LOSS for t in tasks):
        from tessera.infer.engine.llm import LLM

        with LLM(model, **settings.engine) as llm:
            results.update(runner.on_llm(llm))
    ordered = {t: results[t] for t in tasks if t in results}
    ordered.update({t: v for t, v in results.items() if t not in ordered})  # lm-eval groups' subtasks
    return EvalReport(model, tasks, ordered, _config(settings), time.perf_counter() - start)


def _config(s: EvalSettings) -> dict[str, Any]:
    from dataclasses import asdict

    return {"data": s.data, "include_path": s.include_path, "limit": s.limit, "num_fewshot": s.num_fewshot,
            "overrides": list(s.overrides), "engine": dict(s.engine), "humaneval": asdict(s.humaneval),
            "sandbox": asdict(s.sandbox)}
