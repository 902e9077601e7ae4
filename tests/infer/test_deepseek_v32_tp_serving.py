"""DeepSeek-V3.2 served over two tensor-parallel ranks (CPU, gloo): the latent attention's heads are split
as MLA's are, each rank's KV cache holding its own heads' keys and values, while the lightning indexer
stays whole on every rank (replicated weights, every token's indexer key in each rank's cache), so every
rank picks the same keys for its heads. Greedy tokens with prompts cut into chunks and requests joining
while others decode equal one rank's and transformers', over contexts longer than index_topk; and on
ranks forked here, the model cut as serving cuts it chooses at every layer exactly the keys one process
chooses, on both ranks, and its two halves of the vocabulary are one process's logits."""

import pytest
import torch

from tessera.hf import load_pretrained
from tessera.infer import LLM, SamplingParams
from tessera.infer.runner.tensor_parallel import cut_for_serving, serving_dims
from tessera.models.attention_variants import sparse_mla
from tests.forked_ranks import run_ranks
from tests.infer.tiny_models import hf_greedy
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8], [17, 4], [60, 61, 62, 63, 1, 2, 3]]
OPTIONS = dict(block_size=4, max_num_batched_tokens=6, max_num_seqs=4)  # the 13-token prompt in chunks


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v32_tp") / "hf"
    hf = random_hf_model(hf_configs()["deepseek_v32"], seed=3, std=0.2)
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_serve_as_one_rank_and_transformers(pair):
    hf, path = pair
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert hf.config.index_topk < len(PROMPTS[0]) + GREEDY.max_tokens  # the indexer chooses
    assert [o.token_ids for o in LLM(path, **OPTIONS).generate(PROMPTS, GREEDY)] == want
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as two:
        engine = two.engine
        ids, done = [], {}
        for prompt in PROMPTS:  # one request a step: later prompts' chunks beside earlier decodes
            ids.append(engine.add_request(prompt, GREEDY))
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        assert [done[i] for i in ids] == want
        kv = engine.executor.local.kv  # rank 0's cache: half the heads, every indexer key whole
        assert kv.k[0].shape[1] * 2 == hf.config.num_attention_heads
        assert kv.index_k[0].shape[1] == hf.config.index_head_dim


def _choices(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`model`'s logits of `ids` and every key choice its sparse layers made."""
    choices, select = [], sparse_mla.select_keys

    def recording(scores, allowed, topk):
        chosen = select(scores, allowed, topk)
        choices.append(chosen.clone())
        return chosen

    sparse_mla.select_keys = recording
    try:
        with torch.no_grad():
            return model(ids).logits, choices
    finally:
        sparse_mla.select_keys = select


def _rank_choices(path: str, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """On a forked rank: the model cut as serving cuts it (its head: this rank's half of the vocabulary)."""
    model = load_pretrained(path, dtype=torch.float32)
    dims = serving_dims(model.cfg, 2)
    dims.build_mesh("cpu")
    return _choices(cut_for_serving(model, dims), ids)


@pytest.mark.dist
def test_every_rank_chooses_the_keys_one_process_chooses(pair):
    hf, path = pair
    prompt = PROMPTS[0]
    ids = torch.tensor([prompt + hf_greedy(hf, prompt, GREEDY.max_tokens)])
    want_logits, want = _choices(load_pretrained(path, dtype=torch.float32).eval(), ids)
    (logits0, choices0), (logits1, choices1) = run_ranks(_rank_choices, 2, str(path), ids)
    assert len(want) == hf.config.num_hidden_layers and ids.shape[1] > hf.config.index_topk
    may_see = torch.arange(1, ids.shape[1] + 1)
    assert all(bool((c.sum(-1) < may_see).any()) for c in want)  # queries attending to fewer keys than they see
    for a, b, c in zip(choices0, choices1, want, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    torch.testing.assert_close(torch.cat([logits0, logits1], dim=-1), want_logits, atol=1e-5, rtol=1e-5)
