"""lm-eval's `local-completions` backend pointed at `tessera serve` on 127.0.0.1 (log-likelihoods
through `echo` + `logprobs`, generation through `stop`) gives the same requests' results and
metrics as Tessera's in-process model class and as lm-eval's own HuggingFace backend, on local
multiple-choice, perplexity and generation tasks. The tokenizer is the model directory's own,
read by lm-eval's HuggingFace tokenizer backend, told to add the beginning-of-sequence token as
this tokenizer does by default (what lm-eval's HuggingFace backend and Tessera's model class do;
lm-eval's API backends leave it out unless told); nothing is downloaded."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from tessera.eval.harness import task_manager  # noqa: E402
from tessera.eval.lm_eval_model import TesseraLM  # noqa: E402, F401  (registers "tessera" with lm-eval)
from tests.infer.running_server import serving_url, wait_until_serving  # noqa: E402

TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]
# Longer than every document (the model has 256 positions): lm-eval's API backends cut rolling
# windows differently from its HuggingFace backend (max_length - 1 tokens, one kept for generation),
# so documents split into windows would differ between lm-eval's backends, not because of the server.
MAX_LENGTH = 250
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tiny_hf_model):
    """The URL of `tessera serve` on the tiny model, in its own process."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(tiny_hf_model), "--port", "0",
                             "--served-model-name", "tiny", "--block-size", "4", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = serving_url(proc)
        wait_until_serving(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _evaluate(model: str, model_args: str, local_tasks, batch_size: int = 1):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                   task_manager=task_manager(local_tasks, TASKS), batch_size=batch_size,
                                   device="cpu", log_samples=True, bootstrap_iters=0)


def _responses(out, task):
    return [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def _same(theirs, mine, task):
    assert len(theirs) == len(mine) and theirs
    for doc_t, doc_m in zip(theirs, mine):
        assert len(doc_t) == len(doc_m)
        for (resp_t,), (resp_m,) in zip(doc_t, doc_m):
            if task == "tiny_mc":
                assert resp_m[0] == pytest.approx(resp_t[0], rel=1e-5, abs=1e-4)
                assert resp_m[1] == resp_t[1]  # is_greedy, from the top log-probabilities
            elif task == "tiny_ppl":
                assert resp_m == pytest.approx(resp_t, rel=1e-5, abs=1e-4)
            else:
                assert resp_m == resp_t


def test_local_completions_through_the_server_equal_in_process_and_huggingface(served, tiny_hf_model, local_tasks):
    api = _evaluate("local-completions", f"model=tiny,base_url={served}/v1/completions,tokenizer_backend=huggingface,"
                    f"tokenizer={tiny_hf_model},tokenized_requests=True,add_bos_token=True,max_length={MAX_LENGTH},"
                    "max_retries=1",
                    local_tasks, batch_size=4)
    ours = _evaluate("tessera", f"pretrained={tiny_hf_model},max_length={MAX_LENGTH}", local_tasks)
    hf = _evaluate("hf", f"pretrained={tiny_hf_model},dtype=float32,max_length={MAX_LENGTH}", local_tasks)
    for task in TASKS:
        _same(_responses(hf, task), _responses(api, task), task)
        _same(_responses(ours, task), _responses(api, task), task)
        for key, value in hf["results"][task].items():
            if isinstance(value, float) and math.isfinite(value):
                assert api["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)
    assert any(len(r[0][0]) >= 2 for r in _responses(api, "tiny_gen"))  # the server generated text
