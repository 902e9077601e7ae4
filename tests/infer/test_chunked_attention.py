"""Llama 4's chunked local attention (`model.attention_chunk_size`, `ChunkedWindow`): the training
core equals causal attention run on each chunk alone; every CPU serving path (the paged step's
masks with PyTorch ops, the ragged rows the C++ kernel hands back, the static-shape decode step)
attends within each token's chunk, so the engine decodes the tokens of full recomputation for
prompts and completions several chunks long, and the planner counts a chunk's triangle."""

from __future__ import annotations

import pytest
import torch

from tessera.config import get_preset
from tessera.infer import LLM, SamplingParams
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.engine.reference_generation import reference_generate
from tessera.models import Transformer
from tessera.models.attention import ChunkedWindow, causal_attention
from tessera.models.flops import attention_core_flops_per_token, chunked_keys_per_query

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


def test_the_core_attends_within_each_chunk_as_chunks_run_alone():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 11, 8, generator=gen) for h in (4, 2, 2))
    got = causal_attention(q, k, v, 0.3, ChunkedWindow(4))
    for a in range(0, 11, 4):  # chunks [0, 4), [4, 8), [8, 11): each one causal attention of its own
        want = causal_attention(q[:, :, a:a + 4], k[:, :, a:a + 4], v[:, :, a:a + 4], 0.3)
        torch.testing.assert_close(got[:, :, a:a + 4], want)
    assert not torch.allclose(got, causal_attention(q, k, v, 0.3))
    torch.testing.assert_close(causal_attention(q, k, v, 0.3, ChunkedWindow(11)), causal_attention(q, k, v, 0.3))


@pytest.fixture(params=["kernel", "torch"])
def attention_path(request, monkeypatch):
    """The CPU step with the C++ kernel (chunked layers step aside to the ragged PyTorch rows) or
    with PyTorch ops throughout (the paged step's masks)."""
    if request.param == "torch":
        monkeypatch.setenv(cpu_attention.ENV, "torch")
    else:
        monkeypatch.delenv(cpu_attention.ENV, raising=False)
    return request.param


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=5), dict(decode_batch_sizes=[4], windowed_kv="kept")],
                         ids=["chunked-prefill", "static-decode"])
def test_the_engine_decodes_the_tokens_of_full_recomputation(attention_path, options):
    """Chunks of 5 on layer 0 (layer 1 without RoPE sees everything), blocks of 4: prompts and
    completions cross several chunk and block boundaries, in one batch of different lengths."""
    cfg = get_preset("tiny-llama", attention_chunk_size=5, nope_layers=[1], init_std=0.2)
    model = Transformer(cfg, init_seed=2)
    prompts = [[5, 17, 99, 3, 42, 7, 8, 61, 9], [11, 12], [30 + i for i in range(13)]]
    want = [reference_generate(model, p, GREEDY, use_cache=False) for p in prompts]
    llm = LLM(model, block_size=4, **options)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_the_planner_counts_each_chunks_triangle():
    assert chunked_keys_per_query(8192, 8192) == 8192 / 2  # one chunk: plain causal attention
    assert chunked_keys_per_query(10, 4) == (2 * 16 + 4) / 2 / 10  # two chunks of 4 and one of 2
    cfg = get_preset("tiny-llama", n_layers=4, attention_chunk_size=64, nope_layers=[3], max_seq_len=1024)
    per_key = 2 * cfg.n_heads * 2 * cfg.head_dim
    assert attention_core_flops_per_token(cfg, 1024, layer=0) == per_key * 32
    assert attention_core_flops_per_token(cfg, 1024, layer=3) == per_key * 512
