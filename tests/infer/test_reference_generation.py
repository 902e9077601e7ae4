"""The eager reference: its KV cache gives the tokens of full recomputation, greedy is the argmax
and equals `transformers`; the serving engine (what `tessera generate` runs) gives the reference's
tokens, greedy and seeded; the sampler's knobs behave."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ConfigError, get_preset
from tessera.hf import load_pretrained
from tessera.infer import LLM, SamplingParams
from tessera.infer.engine.reference_generation import reference_generate
from tessera.infer.sampling.sampler import next_token
from tessera.models import Transformer
from tests.infer.tiny_models import hf_greedy

TINY = ("tiny-llama", "tiny-moe", "tiny-deepseek")


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_cached_generation_matches_recomputation_and_greedy_argmax():
    for name in TINY:
        model = Transformer(get_preset(name, init_std=0.2), init_seed=3)
        prompt = [5, 17, 99, 3]
        cached = reference_generate(model, prompt, _greedy(8))
        assert cached == reference_generate(model, prompt, _greedy(8), use_cache=False), name
        ids = list(prompt)
        for _ in range(8):  # greedy by hand over the full sequence
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert cached == ids[len(prompt):], name


def test_sliding_window_cache_matches_recomputation():
    model = Transformer(get_preset("tiny-llama", sliding_window=3, init_std=0.2), init_seed=1)
    prompt = [1, 2, 3, 4, 5]
    assert reference_generate(model, prompt, _greedy(6)) == reference_generate(model, prompt, _greedy(6),
                                                                               use_cache=False)


def test_chunked_attention_cache_matches_recomputation():
    """Llama 4's chunks on the rotated layer 0 (layer 1 without RoPE sees everything): the cache attends
    within each token's chunk as the whole-sequence mask does, and the chunks change the tokens."""
    cfg = get_preset("tiny-llama", attention_chunk_size=3, nope_layers=[1], init_std=0.2)
    model, prompt = Transformer(cfg, init_seed=1), [1, 2, 3, 4, 5]
    cached = reference_generate(model, prompt, _greedy(8))
    assert cached == reference_generate(model, prompt, _greedy(8), use_cache=False)
    whole = Transformer(get_preset("tiny-llama", nope_layers=[1], init_std=0.2), init_seed=1)
    assert cached != reference_generate(whole, prompt, _greedy(8))


def test_reference_greedy_equals_transformers(llama):
    path, hf = llama
    model = load_pretrained(path)
    prompt = [0, 40, 41, 42, 43]
    assert reference_generate(model, prompt, _greedy(16)) == hf_greedy(hf, prompt, 16)


@pytest.mark.parametrize("name, overrides", [("tiny-llama", {}), ("tiny-llama", {"sliding_window": 3}),
                                             ("tiny-llama", {"attention_chunk_size": 3, "nope_layers": [1]}),
                                             ("tiny-moe", {}), ("tiny-deepseek", {})],
                         ids=["llama", "sliding-window", "chunked", "moe", "mla"])
def test_engine_gives_the_reference_tokens(name, overrides):
    """Paged cache, chunked prefill (a token budget of 3) and the engine's stop rules: the same
    tokens as the eager reference, greedy and sampled with a seed, and the same stop at a stop id."""
    model = Transformer(get_preset(name, init_std=0.2, **overrides), init_seed=3)
    llm = LLM(model, block_size=4, max_num_batched_tokens=3)
    prompt = [5, 17, 99, 3, 42, 7, 8]
    for params in (_greedy(10), SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=11)):
        want = reference_generate(model, prompt, params)
        assert llm.generate([prompt], params)[0].token_ids == want, (name, params)
    stop_at = want[3]
    stopped = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=11, stop_token_ids=[stop_at])
    out = llm.generate([prompt], stopped)[0]
    assert out.token_ids == reference_generate(model, prompt, stopped) == want[:want.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_generation_ends_at_the_model_length():
    model = Transformer(get_preset("tiny-llama", max_seq_len=12, init_std=0.2), init_seed=0)
    prompt = list(range(1, 9))
    assert len(reference_generate(model, prompt, _greedy(10))) == 4  # 8 + 4 = max_seq_len positions
    assert reference_generate(model, list(range(12)), _greedy(3)) == []


def test_sampling_knobs():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    g = torch.Generator().manual_seed(0)
    assert next_token(logits, _greedy(1), None) == 1
    assert all(next_token(logits, SamplingParams(temperature=1.0, top_k=1), g) == 1 for _ in range(20))
    assert all(next_token(logits, SamplingParams(temperature=1.0, top_p=0.1), g) == 1 for _ in range(20))
    two = {next_token(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert two == {1, 2}
    model = Transformer(get_preset("tiny-llama", init_std=0.5), init_seed=0)

    def sample(seed: int, **kw) -> list[int]:
        return reference_generate(model, [1, 2], SamplingParams(max_tokens=10, temperature=1.0, seed=seed, **kw))

    a = sample(5)
    assert a == sample(5)
    assert a != sample(6)
    assert sample(5, stop_token_ids=[a[0]]) == a[:1]


def test_a_model_in_memory_must_match_the_engine_dtype():
    model = Transformer(get_preset("tiny-llama"), init_seed=0)
    with pytest.raises(ConfigError, match=r"the model is float32 on cpu but the engine is configured for "
                                          r"dtype='bfloat16'"):
        LLM(model, dtype="bfloat16")
    with pytest.raises(ConfigError, match="tokenizer= and eos_ids= go with a model in memory"):
        LLM("any/directory", eos_ids=[1])
