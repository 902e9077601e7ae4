"""Generation: the KV cache gives the tokens of full recomputation; sampling knobs behave."""

from __future__ import annotations

import torch

from tessera.config import get_preset
from tessera.models import Transformer
from tessera.train.text_generation import generate, next_token


def test_cached_generation_matches_recomputation_and_greedy_argmax():
    for name in ("tiny-llama", "tiny-moe", "tiny-deepseek"):
        model = Transformer(get_preset(name, init_std=0.2), init_seed=3)
        prompt = [5, 17, 99, 3]
        cached = generate(model, prompt, 8)
        assert cached == generate(model, prompt, 8, use_cache=False), name
        ids = list(prompt)
        for _ in range(8):  # greedy by hand over the full sequence
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert cached == ids[len(prompt):], name


def test_sliding_window_cache_matches_recomputation():
    model = Transformer(get_preset("tiny-llama", sliding_window=3, init_std=0.2), init_seed=1)
    assert generate(model, [1, 2, 3, 4, 5], 6) == generate(model, [1, 2, 3, 4, 5], 6, use_cache=False)


def test_sampling_knobs():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    g = torch.Generator().manual_seed(0)
    assert next_token(logits) == 1
    assert all(next_token(logits, 1.0, top_k=1, generator=g) == 1 for _ in range(20))
    assert all(next_token(logits, 1.0, top_p=0.1, generator=g) == 1 for _ in range(20))
    two = {next_token(logits, 1.0, top_k=2, generator=g) for _ in range(200)}
    assert two == {1, 2}
    model = Transformer(get_preset("tiny-llama", init_std=0.5), init_seed=0)
    a = generate(model, [1, 2], 10, temperature=1.0, seed=5)
    assert a == generate(model, [1, 2], 10, temperature=1.0, seed=5)
    assert a != generate(model, [1, 2], 10, temperature=1.0, seed=6)
    assert generate(model, [1, 2], 10, stop_ids=(a[0],), temperature=1.0, seed=5) == a[:1]
