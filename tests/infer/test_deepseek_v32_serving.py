"""DeepSeek-V3.2 served by the paged engine (tessera/infer/runner/sparse_attention.py): the indexer
keys live in the KV cache beside each token's keys and values and are counted in a block's bytes; the
indexer runs in the paged step, so greedy tokens equal transformers' with prompts cut into chunks and
requests batched together, preempted requests recomputed, and a prompt whose prefix is cached, over
contexts several times longer than index_topk (tensor-parallel serving: test_deepseek_v32_tp_serving.py;
drafts from the model's own MTP layer: test_deepseek_v32_mtp_serving.py)."""

import pytest
import torch

from tessera.infer import LLM, SamplingParams
from tessera.infer.scheduling.kv_cache import PagedKVCache, bytes_per_block
from tests.infer.tiny_models import hf_greedy
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")
PROMPTS = [[3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8], [17, 4], [60, 61, 62, 63, 1, 2, 3]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v32_serving") / "hf"
    hf = random_hf_model(hf_configs()["deepseek_v32"], seed=3, std=0.2)
    hf.save_pretrained(path)
    return hf, path


def test_greedy_with_chunked_prefill_and_batching_equals_transformers(pair):
    hf, path = pair
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(hf, p, 10) for p in PROMPTS]
    llm = LLM(path, block_size=4, max_num_batched_tokens=6)  # the 13-token prompt runs in three chunks
    assert llm.engine.kv.index_k[0].shape[1] == 8  # index_head_dim
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    hits = llm.engine.blocks.cache.hit_tokens
    assert llm.generate([PROMPTS[0]], params)[0].token_ids == want[0]  # its prompt's blocks are cached now
    assert llm.engine.blocks.cache.hit_tokens > hits


def test_preempted_requests_recompute_to_transformers_tokens(pair):
    hf, path = pair
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(10 + i)] for i in range(4)]
    llm = LLM(path, block_size=4, num_blocks=16, max_model_len=32, max_num_seqs=4, enable_prefix_caching=False)
    outs = llm.generate(prompts, params)
    assert llm.engine.metrics.preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def test_a_block_counts_the_indexer_keys(pair):
    _, path = pair
    cfg = LLM(path, block_size=4).engine.model.cfg
    m = cfg.mla
    per_token = cfg.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) + m.index_head_dim
    assert bytes_per_block(cfg, 4, torch.float32, False) == per_token * 4 * 4 * cfg.n_layers
    kv = PagedKVCache(cfg, 3, 4, torch.float32)
    assert kv.nbytes == 3 * bytes_per_block(cfg, 4, torch.float32, False)
