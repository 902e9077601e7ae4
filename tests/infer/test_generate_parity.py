"""Greedy output equals HuggingFace `generate` token for token: one prompt, a batch of different
lengths under a small token budget (chunked prefill mixed with decodes), with and without prefix
reuse, with both speculative methods, under preemption, and for more families."""

import pytest

from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tests.infer.tiny_models import hf_greedy, write_model

FAMILIES = ["llama", "mixtral"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog, twice: the quick brown fox",
           "def f(x):\n    return x * 2\n", "zz"]


def _expected(hf, llm, prompts, n=24):
    return [hf_greedy(hf, llm.tokenizer.encode(p), n) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_prompt_matches_hf(family, family_models):
    path, hf = family_models[family]
    llm = LLM(path, block_size=4)
    [out] = llm.generate(["Once upon a time"], GREEDY)
    assert out.token_ids == _expected(hf, llm, ["Once upon a time"])[0]
    assert out.finish_reason == "length" and len(out.text) == 24


@pytest.mark.parametrize("policy", ["shortest_first", "fcfs"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_different_lengths_matches_hf(family, family_models, policy):
    path, hf = family_models[family]
    llm = LLM(path, block_size=4, max_num_batched_tokens=20, enable_prefix_caching=False, scheduling_policy=policy)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == _expected(hf, llm, PROMPTS)


@pytest.mark.parametrize("policy", ["shortest_first", "fcfs"])
def test_prompts_queued_together_get_their_first_tokens_in_policy_order(llama, policy):
    """Prompts queued at once under a 20-token budget: shortest_first prefills them shortest first,
    fcfs in the order they came; either way each gets its first token no later than the next."""
    path, _ = llama
    llm = LLM(path, block_size=4, max_num_batched_tokens=20, enable_prefix_caching=False, scheduling_policy=policy)
    engine = llm.engine
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    first_step, step = {}, 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            first_step.setdefault(out.request_id, step)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if policy == "shortest_first" else range(5)
    steps = [first_step[ids[i]] for i in order]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] > 1, steps


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_reuse_gives_identical_output(family, family_models):
    path, hf = family_models[family]
    shared = "System: you are a terse assistant who answers in one line.\n"
    prompts = [shared + q for q in ("User: hi", "User: what is 2+2?", "User: name a colour")]
    want = _expected(hf, LLM(path, block_size=4, enable_prefix_caching=False), prompts)
    llm = LLM(path, block_size=4, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    again = llm.generate(prompts[:1], GREEDY)
    assert [o.token_ids for o in first + rest] == want
    assert again[0].token_ids == want[0]
    cache = llm.engine.blocks.cache
    assert cache.hit_tokens >= 3 * (len(llm.tokenizer.encode(shared)) // 4) * 4
    assert 0 < cache.hit_rate < 1


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_prompt_lookup_matches_hf(family, family_models):
    path, hf = family_models[family]
    spec = SpeculativeConfig(method="prompt_lookup", num_tokens=3, ngram_max=2)
    llm = LLM(path, block_size=4, speculative=spec)
    prompts = PROMPTS + ["abcabcabcabcabcabc"]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == _expected(hf, llm, prompts)
    m = llm.engine.metrics
    assert m.spec_proposed > 0 and m.spec_steps > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_draft_model_matches_hf(family, family_models, tmp_path):
    path, hf = family_models[family]
    write_model(tmp_path / "draft", family, seed=7, std=0.25, num_hidden_layers=1)
    for draft, expect_accepts in ((tmp_path / "draft", False), (path, True)):
        llm = LLM(path, block_size=4, max_num_batched_tokens=32,
                  speculative=SpeculativeConfig(method="draft", num_tokens=3, draft_model=str(draft)))
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == _expected(hf, llm, PROMPTS)
        m = llm.engine.metrics
        assert m.spec_proposed > 0
        if expect_accepts:  # the target as its own draft: every proposal is accepted
            assert m.acceptance_rate > 0.99 and m.tokens_per_step > 3.5


def test_preemption_recomputes_to_the_same_output(llama):
    path, hf = llama
    llm = LLM(path, block_size=4, num_blocks=24, max_model_len=64, max_num_seqs=8, enable_prefix_caching=False)
    prompts = [f"prompt number {i} is here" for i in range(6)]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.metrics.preemptions > 0
    assert [o.token_ids for o in outs] == _expected(hf, llm, prompts)
    assert llm.engine.blocks.num_free_blocks == 24


@pytest.mark.parametrize("family", [
    "mistral", "qwen3_moe", "deepseek_v3", "smollm3", "olmo2", "olmo3",
    "seed_oss", "exaone4", "llama4_text", "glm4_moe", "gpt_oss",
    "phi3",
    "gemma3_text",
])
def test_other_families_match_hf(family, tmp_path):
    hf = write_model(tmp_path, family, std=0.25)
    llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=16)
    prompts = ["sliding windows see only recent keys", "hi"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _expected(hf, llm, prompts, 12)
