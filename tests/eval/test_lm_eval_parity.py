"""lm-eval through Tessera's model class equals lm-eval's own HuggingFace backend on the same model:
every request's log-likelihood and greedy flag, every rolling log-likelihood, every generated text
(stopped at the task's stop strings), and so every metric, on local multiple-choice, perplexity and
generation tasks."""

from __future__ import annotations

import math

import pytest

lm_eval = pytest.importorskip("lm_eval")

from tessera.eval.harness import task_manager  # noqa: E402
from tessera.eval.lm_eval_model import TesseraLM  # noqa: E402

TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]
MAX_LENGTH = 64  # shorter than two of the perplexity documents: rolling windows and left truncation


def _evaluate(model: str, model_args: str, local_tasks):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                   task_manager=task_manager(local_tasks, TASKS), batch_size=1, device="cpu",
                                   log_samples=True, bootstrap_iters=0)


def _responses(out, task):
    return [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def test_tessera_model_is_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("tessera") is TesseraLM


def test_every_request_and_metric_equals_the_huggingface_backend(tiny_hf_model, local_tasks):
    hf = _evaluate("hf", f"pretrained={tiny_hf_model},dtype=float32,max_length={MAX_LENGTH}", local_tasks)
    ours = _evaluate("tessera", f"pretrained={tiny_hf_model},max_length={MAX_LENGTH}", local_tasks)

    for task in ("tiny_mc", "tiny_ppl"):
        theirs, mine = _responses(hf, task), _responses(ours, task)
        assert len(theirs) == len(mine) and theirs
        for doc_t, doc_m in zip(theirs, mine):
            for (resp_t,), (resp_m,) in zip(doc_t, doc_m):
                if task == "tiny_mc":
                    assert resp_m[0] == pytest.approx(resp_t[0], rel=1e-5, abs=1e-4)
                    assert resp_m[1] == resp_t[1]
                else:
                    assert resp_m == pytest.approx(resp_t, rel=1e-5, abs=1e-4)
    generated_t, generated_m = _responses(hf, "tiny_gen"), _responses(ours, "tiny_gen")
    assert generated_m == generated_t
    texts = [r[0][0] for r in generated_m]
    assert sum(len(t) >= 2 for t in texts) >= 2, texts  # the model wrote something
    assert any(len(t) < 12 for t in texts), texts  # and a stop string ended one before max_gen_toks
    assert not any("O" in t or "\n" in t for t in texts)  # cut at the task's stop strings

    for task in TASKS:
        for key, value in hf["results"][task].items():
            if isinstance(value, float) and math.isfinite(value):
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)


def test_the_example_task_runs_from_the_repository_root_as_the_readme_says(tiny_hf_model, tmp_path, monkeypatch,
                                                                          capsys):
    """examples/tasks/python_syntax.yaml (its data named relative to the repository root) through
    `tessera eval`: all 40 questions, the right choice in each position in turn, and the accuracies
    lm-eval's HuggingFace backend gives the same model."""
    import json
    from pathlib import Path

    from tessera.cli import main

    root = Path(__file__).resolve().parents[2]
    questions = [json.loads(line) for line in (root / "examples/tasks/python_syntax.jsonl").read_text().splitlines()]
    assert [q["answer"] for q in questions] == [i % 3 for i in range(40)]
    monkeypatch.chdir(root)
    out = tmp_path / "results.json"
    assert main(["eval", str(tiny_hf_model), "--tasks", "python_syntax", "--include-path", "examples/tasks",
                 "--output", str(out)]) == 0
    ours = json.loads(out.read_text())["results"]["python_syntax"]
    tasks = task_manager("examples/tasks", ["python_syntax"])
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tiny_hf_model},dtype=float32",
                                 tasks=["python_syntax"], task_manager=tasks, batch_size=1, device="cpu",
                                 bootstrap_iters=0)
    assert hf["n-samples"]["python_syntax"]["effective"] == 40
    for metric in ("acc", "acc_norm"):
        assert ours[metric] == pytest.approx(hf["results"]["python_syntax"][f"{metric},none"], rel=1e-6)
    assert "python_syntax" in capsys.readouterr().out
