"""HumanEval's chat (instruct) mode: an instruct model asked, through its chat template, to complete
the function, and its answer turned back into a program.

An instruct model continuing a raw prompt tends to close the code and answer in prose; the field
evaluates such models as the "instruct" protocol of evalplus and bigcode's harness does, which this
module follows in its own words:

    text = chat_prompt(tokenizer, problem)        # one user turn: the instruction and the prompt's code
    completion = completion_from_answer(problem, answer)

The code is the answer's first fenced block (```python, ``` or an unclosed fence to the end), else
the whole answer. Where it defines the problem's function, it is appended after the prompt (the
prompt's signature and docstring make a function of its own, which the answer's definition then
replaces; the prompt's imports and helper functions stay in scope). Where it does not, it is taken
as the function's body: lines without indentation are indented by four spaces.
"""

from __future__ import annotations

import re

from tessera.config.errors import ConfigError

MODES = ("raw", "chat")
INSTRUCTION = ("Complete the following Python function. Reply with the whole function, its signature included, "
               "in one ```python code block.")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S | re.I)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"humaneval mode={mode!r} is invalid: one of {', '.join(MODES)}")
    return mode


def chat_messages(problem: dict) -> list[dict[str, str]]:
    """The one user turn that asks for the function of `problem`."""
    return [{"role": "user", "content": f"{INSTRUCTION}\n\n```python\n{problem['prompt'].rstrip()}\n```"}]


def chat_prompt(tokenizer, problem: dict) -> str:
    """The user turn rendered by the model's chat template, with the assistant's turn opened."""
    if tokenizer is None or not tokenizer.has_chat_template:
        raise ConfigError("humaneval mode=chat needs the model's chat template, and this model's tokenizer has none: "
                          "use --humaneval-mode raw")
    return tokenizer.apply_chat_template(chat_messages(problem), add_generation_prompt=True)


def extract_code(answer: str) -> str:
    """The first fenced code block of `answer` (to its end when the fence is not closed), else the
    whole answer."""
    m = _FENCE.search(answer)
    return m.group(1) if m else answer


def completion_from_answer(problem: dict, answer: str) -> str:
    """What follows the problem's prompt in the program that is tested (humaneval.check_program)."""
    code = extract_code(answer).strip("\n")
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.M):
        return "\n    pass\n\n" + code + "\n"
    lines = code.splitlines()
    indented = all(not line.strip() or line[:1] in " \t" for line in lines)
    body = lines if indented else ["    " + line if line.strip() else line for line in lines]
    return "\n".join(body) + "\n"
