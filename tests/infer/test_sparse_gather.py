"""Sparse attention over the gathered chosen keys (tessera/models/attention_variants/sparse_gather.py) is the
masked form's attention: over keys and values gathered at each query's chosen indices (early queries with
fewer than k keys to choose from included) it equals SDPA under the chosen mask (fp32). The engine's step
(tessera/infer/runner/sparse_attention.py) reads a decode's chosen slots straight from the KV cache where
they are at most half its context (`gathers`), and a served DeepSeek-V3.2 then decodes the tokens it
decodes with every step masked, and transformers' tokens, in a full-precision and an int8 cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.infer import LLM, SamplingParams
from tessera.infer.runner import sparse_attention
from tessera.models.attention_variants.sparse_gather import attend_gathered, chosen_indices, gathers
from tessera.models.attention_variants.sparse_mla import select_keys
from tests.infer.tiny_models import hf_greedy
from tests.models.hf_families import hf_configs, random_hf_model

H, T, D, V = 3, 40, 12, 10
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8], [17, 4, 9]]


@pytest.mark.parametrize("topk", [1, 5, 10])
def test_attention_over_the_gathered_keys_equals_the_masked_form(topk):
    g = torch.Generator().manual_seed(topk)
    q, k = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    v = torch.randn(T, H, V, generator=g)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    chosen = select_keys(torch.randn(1, T, T, generator=g).relu(), causal[None], topk)[0]  # ReLU: exact ties
    assert (chosen.sum(-1) == topk).any() and (topk == 1 or (chosen.sum(-1) < topk).any())
    idx, valid = chosen_indices(chosen, topk)
    assert torch.equal(valid.sum(-1), chosen.sum(-1)) and all(chosen[i, idx[i][valid[i]]].all() for i in range(T))
    got = attend_gathered(q, k[idx], v[idx], valid, 0.3)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=chosen, scale=0.3).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_gather_is_taken_where_it_reads_at_most_half_the_rows():
    assert gathers(1, 4, 8) and not gathers(1, 4, 7)  # a decode: 4 chosen of 8 keys, not of 7
    assert gathers(3, 4, 24) and not gathers(13, 4, 13)  # a prompt's own queries never gather


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v32_gather") / "hf"
    hf = random_hf_model(hf_configs()["deepseek_v32"], seed=3, std=0.2)
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_served_decodes_gather_their_chosen_slots_and_keep_the_tokens(pair, kv_cache_dtype, monkeypatch):
    hf, path = pair
    read = sparse_attention._attend_chosen_slots
    gathered = []

    def counted(kv, layer_id, blocks, q_SHD, chosen_SL, topk, scale):
        gathered.append(q_SHD.shape[0])
        return read(kv, layer_id, blocks, q_SHD, chosen_SL, topk, scale)

    monkeypatch.setattr(sparse_attention, "_attend_chosen_slots", counted)
    options = dict(block_size=4, max_num_batched_tokens=8, kv_cache_dtype=kv_cache_dtype)
    got = [o.token_ids for o in LLM(path, **options).generate(PROMPTS, GREEDY)]
    assert gathered and set(gathered) == {1}  # decodes only
    monkeypatch.setattr(sparse_attention, "gathers", lambda queries, topk, keys: False)  # every step masked
    assert [o.token_ids for o in LLM(path, **options).generate(PROMPTS, GREEDY)] == got
    if kv_cache_dtype is None:
        assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
