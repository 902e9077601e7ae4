"""DeepSeek-V3.2 served with its own MTP layer as the drafter (`speculative.method="mtp"`,
tessera/infer/runner/mtp_proposer.py): the MTP layer's block attends sparsely with an indexer of its own,
and the drafter's one-layer paged cache keeps that indexer's keys beside its keys and values, so at the
catch-up its logits equal the model's own MTP forward over the whole sequence (fp32 1e-5) on contexts
several times longer than index_topk. Greedy tokens with drafts (1 and 3 a step) equal those without and
transformers' (which loads the directory without the MTP layer), with chunked prefill and batching,
preemption (recomputed) and a prefix-cache hit; an MTP layer trained on the target's own continuations
has drafts accepted (the count measured, never a speed); served over HTTP the same."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tessera.hf import load_pretrained, save_pretrained
from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.infer.runner.mtp_proposer import MTPProposer
from tessera.models.attention_variants.sparse_mla import SparseLatentAttention
from tessera.models.chunked_cross_entropy import IGNORE_INDEX
from tessera.models.model_input import ModelInput
from tessera.models.mtp import depth_inputs
from tessera.models.transformer import Transformer
from tests.infer.tiny_models import char_tokenizer, hf_greedy, save_tokenizer
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")
PROMPTS = [[3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8], [17, 4], [60, 61, 62, 63, 1, 2, 3]]
NEW = 12  # tokens each: a context reaches 25 tokens, index_topk is 4


def _train_mtp_to_agree(model: Transformer, sequences: list[list[int]], steps: int = 60) -> None:
    """Fit the MTP layer (the main model and the indexers frozen) to the target's own greedy continuations,
    so its drafts are often what the target decodes."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp.") and ".indexer." not in name)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        for s in sequences:
            ids = torch.tensor([s])
            targets = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
            model(ModelInput(tokens=ids, targets=targets)).mtp_loss_sum.backward()
        opt.step()
    model.requires_grad_(False)


class Served(NamedTuple):
    hf: torch.nn.Module  # transformers' model: the oracle
    path: Path  # the directory with the MTP layer
    want: list[list[int]]  # transformers' greedy continuations of PROMPTS
    model: Transformer  # what the directory holds


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """transformers' random DeepSeek-V3.2 (the oracle) and a directory holding its weights and an MTP layer
    trained to agree with it; the greedy continuations of PROMPTS."""
    root = tmp_path_factory.mktemp("deepseek_v32_mtp")
    hf = random_hf_model(hf_configs()["deepseek_v32"], seed=3, std=0.2)
    hf.save_pretrained(root / "hf")
    main = load_pretrained(root / "hf")
    model = Transformer(replace(main.cfg, mtp_depth=1, init_std=0.2), init_seed=5)
    missing, unexpected = model.load_state_dict(main.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("mtp.") for k in missing)
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    _train_mtp_to_agree(model, [p + w for p, w in zip(PROMPTS, want)])
    save_pretrained(model.eval(), root / "mtp")
    save_tokenizer(root / "mtp")
    return Served(hf, root / "mtp", want, model)


def _spec(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", num_tokens=k)


def test_the_directory_holds_the_mtp_layer_with_its_own_indexer(served):
    """The MTP layer's block is sparse attention with an indexer of its own (`model.layers.{L}.self_attn.indexer`
    in the directory), read back bit for bit."""
    model = LLM(served.path, block_size=4).engine.model
    assert model.cfg.mtp_depth == 1 and model.cfg.mla.index_topk == 4
    attention = model.mtp["1"].block.attention
    assert isinstance(attention, SparseLatentAttention)
    assert not torch.equal(attention.indexer.wk.weight, model.layers["1"].attention.indexer.wk.weight)
    want = served.model.mtp.state_dict()
    assert any(".indexer." in k for k in want)
    assert all(torch.equal(v, want[k]) for k, v in model.mtp.state_dict().items())


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_drafts_equals_transformers_with_chunked_prefill_and_batching(served, k):
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    plain = LLM(served.path, block_size=4, max_num_batched_tokens=6).generate(PROMPTS, params)
    llm = LLM(served.path, block_size=4, max_num_batched_tokens=6, enable_prefix_caching=False,
              speculative=_spec(k))
    outs = llm.generate(PROMPTS, params)  # the 13-token prompt runs in three chunks
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] == served.want
    m = llm.engine.metrics
    assert m.spec_proposed > 0 and m.spec_accepted > 0  # drafts were made and some held


def test_the_drafter_logits_at_the_catch_up_equal_the_model_own_mtp_forward(served, monkeypatch):
    """Every catch-up of every step (positions up to N-2, the target's hidden states) against depth 1 of
    the model's MTP forward over the whole sequence at position N-2: fp32 1e-5, the sparse choice over up
    to 25 keys with index_topk 4 included."""
    llm = LLM(served.path, block_size=4, max_num_batched_tokens=6, enable_prefix_caching=False, speculative=_spec(2))
    model = llm.engine.model
    seen: list[tuple[list[int], torch.Tensor]] = []
    run = MTPProposer._run

    def traced(self, rows):
        last, logits = run(self, rows)
        for r, row_logits in zip(rows, logits):
            if r.start + len(r.tokens) == len(r.seq.token_ids) - 1:  # a catch-up row (a chain row starts past)
                seen.append((list(r.seq.token_ids), row_logits.clone()))
        return last, logits

    monkeypatch.setattr(MTPProposer, "_run", traced)
    llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert len(seen) > 2 * len(PROMPTS) and max(len(s) for s, _ in seen) > 5 * model.cfg.mla.index_topk
    for tokens, got in seen:
        torch.testing.assert_close(got, _own_mtp_logits(model, tokens), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def _own_mtp_logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Depth 1 of the model's MTP forward (no cache) over `tokens`: its logits at position N-2."""
    ids = torch.tensor([tokens])
    out = model(ModelInput(tokens=ids))
    rope = model.rope_tables(torch.arange(len(tokens))[None], out.last_hidden.dtype)
    module = model.mtp["1"]
    h, _ = module(out.last_hidden, model.tok_embeddings(depth_inputs(ids, 1)), rope.cos, rope.sin)
    return model.lm_head(module.norm(h[0, -2]))


def test_preempted_requests_with_drafts_recompute_to_transformers_tokens(served):
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(10 + i)] for i in range(4)]
    llm = LLM(served.path, block_size=4, num_blocks=16, max_model_len=32, max_num_seqs=4, enable_prefix_caching=False,
              speculative=_spec(3))
    outs = llm.generate(prompts, params)
    assert llm.engine.metrics.preemptions > 0 and llm.engine.metrics.spec_proposed > 0
    assert [o.token_ids for o in outs] == [hf_greedy(served.hf, p, NEW) for p in prompts]


def test_a_prefix_cache_hit_with_drafts_decodes_to_transformers_tokens(served):
    """The second prompt starts past 4 cached blocks: it drafts nothing (no hidden states for them) and both
    decode to transformers' tokens."""
    prompts = [list(range(1, 17)) + [3, 4], list(range(1, 17)) + [7]]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(served.path, block_size=4, speculative=_spec(2))
    first = llm.generate(prompts[:1], params)
    drafted, hits = llm.engine.metrics.spec_proposed, llm.engine.blocks.cache.hit_tokens
    second = llm.generate(prompts[1:], params)
    assert llm.engine.blocks.cache.hit_tokens >= hits + 16
    assert drafted > 0 and llm.engine.metrics.spec_proposed == drafted
    assert [o.token_ids for o in first + second] == [hf_greedy(served.hf, p, NEW) for p in prompts]


def test_served_over_http_with_mtp_drafts(served):
    """The directory served with speculation "mtp" answers transformers' greedy tokens and /metrics counts
    the drafts."""
    import httpx

    from tessera.infer import EngineConfig, LLMEngine
    from tests.hang_guard import HANG_S
    from tests.infer.running_server import RunningServer

    tok, prompt = char_tokenizer(), PROMPTS[0]
    engine = LLMEngine.from_dir(served.path, EngineConfig(block_size=4, speculative={"method": "mtp", "num_tokens": 2}))
    with RunningServer(engine, name="v32") as s:
        body = {"model": "v32", "prompt": prompt, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=HANG_S)
        text = httpx.get(s.url + "/metrics", timeout=HANG_S).text
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(served.want[0], skip_special_tokens=True)
    proposed = [ln for ln in text.splitlines() if ln.startswith("tessera_spec_proposed_tokens_total")]
    assert proposed and float(proposed[0].split()[-1]) > 0
