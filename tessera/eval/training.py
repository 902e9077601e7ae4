"""`train.eval_tasks`: the evaluator a run calls at each evaluation (`tessera.train.run.task_evaluation`).

    trainer = Trainer(cfg, task_evaluator=TrainingTasks(cfg))     # what `tessera train` does

It is made when the run starts, so that an unknown task name or a sandbox that cannot run
(`humaneval`) stops the run before its first step. At each evaluation it serves the whole model of
that step, in fp32 on the training device, with the run's tokenizer (an `LLM` around the model in
memory, CUDA graphs off: the model is new each time), runs the tasks (`tessera.eval.suite`) with
`train.eval_tasks_path` and `train.eval_tasks_limit`, and returns their metrics as
`"<task>/<metric>"`, which the trainer writes to metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

from tessera.config.errors import ConfigError
from tessera.config.schema import RunConfig
from tessera.data.tokenizer import load_tokenizer
from tessera.eval.suite import EvalSettings, TaskRunner
from tessera.infer.engine.llm import LLM
from tessera.models.transformer import Transformer


class TrainingTasks:
    def __init__(self, cfg: RunConfig):
        t = cfg.train
        if not t.eval_tasks:
            raise ConfigError("train.eval_tasks is empty: there is nothing for TrainingTasks to run")
        self.runner = TaskRunner(list(t.eval_tasks), EvalSettings(include_path=t.eval_tasks_path,
                                                                  limit=t.eval_tasks_limit))
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        if self.tokenizer.eos_id is None:
            raise ConfigError("train.eval_tasks needs a tokenizer with an eos_token (data.tokenizer)")

    def __call__(self, model: Transformer, step: int) -> dict[str, float]:
        device = next(model.parameters()).device
        with LLM(model, tokenizer=self.tokenizer, eos_ids=[self.tokenizer.eos_id], dtype="float32",
                 device=str(device), enforce_eager=True) as llm:
            results = self.runner.on_llm(llm)
        return {f"{task}/{metric}": value for task, metrics in results.items() for metric, value in metrics.items()}
