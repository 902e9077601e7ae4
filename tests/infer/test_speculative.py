"""Prompt lookup proposals, and the speculative metrics on text that repeats itself."""

import pytest

from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.infer.runner.speculative import ngram_lookup
from tests.infer.host_transfers import HostTransfers
from tests.infer.tiny_models import hf_greedy, write_model


def test_ngram_lookup_prefers_a_full_continuation():
    assert ngram_lookup([1, 2, 3, 9, 1, 2], 3, 2, 1) == [3, 9, 1]
    assert ngram_lookup([1, 2, 3, 1, 2, 3, 1, 2, 3], 4, 3, 1) == [1, 2, 3, 1]  # not the 1-token tail match
    assert ngram_lookup([7, 8, 9], 3, 2, 1) == []
    assert ngram_lookup([4, 5, 6, 4], 2, 3, 1) == [5, 6]  # falls back to shorter n-grams


def test_prompt_lookup_accepts_most_tokens_when_the_output_repeats(tmp_path):
    hf = write_model(tmp_path, "llama", std=0.08)  # small weights: greedy output falls into a loop
    llm = LLM(tmp_path, block_size=4, speculative=SpeculativeConfig(method="prompt_lookup", num_tokens=4))
    out = llm.generate(["loop"], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, llm.tokenizer.encode("loop"), 48)
    m = llm.engine.metrics
    assert m.acceptance_rate > 0.5 and m.tokens_per_step > 2.5
    assert m.steps < 30  # far fewer target forward passes than tokens


@pytest.mark.parametrize("method", ["prompt_lookup", "draft"])
def test_greedy_speculative_steps_transfer_once_per_model_call(llama, method):
    """Greedy requests verify their proposals with the argmax rows of the step's one transfer; a
    draft model brings each drafted token of the whole batch over in one transfer per draft pass."""
    path, _ = llama
    k = 3
    spec = SpeculativeConfig(method=method, num_tokens=k, ngram_max=2, draft_model=str(path))
    llm = LLM(path, block_size=4, speculative=spec)
    engine = llm.engine
    prompts = ["abcabcabcabcabc", "xyzxyzxyzxyz", "one two one two one"]
    for prompt in prompts:
        engine.add_request(llm.tokenizer.encode(prompt), SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True))
    engine.step()  # the prefill
    steps = 0
    while engine.has_unfinished():
        with HostTransfers() as mode:
            engine.step()
        steps += 1
        assert set(mode.calls) == {"tolist"}, mode.calls  # no .item(), int(tensor), ...
        # prompt lookup: the step's transfer only; a draft: its k passes (fewer near max_tokens) too
        assert 1 <= len(mode.calls) <= (1 + k if method == "draft" else 1), mode.calls
    assert engine.metrics.spec_accepted > 0 and steps < 11  # 11 tokens after the prefill's
