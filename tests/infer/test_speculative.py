"""Prompt lookup proposals, and the speculative metrics on text that repeats itself."""

from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.infer.speculative import ngram_lookup
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
