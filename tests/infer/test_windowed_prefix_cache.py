"""Prefix caching over a windowed pool (`--windowed-kv bounded`, infer/scheduling/window_blocks.py): a
named block keeps the window block of its positions, so a request sharing a prefix many windows long
with an earlier one takes the prefix from the cache (cached tokens in its usage) and decodes
transformers' greedy tokens (Gemma 3's and gpt-oss's sliding windows, Llama 4's chunks), prompt
chunks cut across the window; requests with different prefixes interleaved never hold each other's
window blocks; window blocks evicted from a small pool cut a later hit back to where they are all
kept, are kept again when a request computes the same blocks, and nothing leaks; preempted requests
sharing a prefix come back from the cache; a pinned system prompt is found with its window blocks;
the server reports the hit in a completion's usage;
two tensor-parallel ranks share a prefix the same way; the benchmark computes the same tokens in each
of its modes; the ring takes a fresh block rather than write over a kept one."""

from __future__ import annotations

import httpx
import pytest
import torch

from tessera.data.tokenizer import Tokenizer
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.infer.scheduling.prefix_cache import hash_chain
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer, prefix_hit_tokens
from tests.infer.tiny_models import hf_greedy, write_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHARED = [(7 * i + 3) % 90 + 5 for i in range(26)]  # 6 full blocks of 4 (five windows of 5), and 2 more tokens


def _serve(engine: LLMEngine, prompts: list[list[int]], watch=None) -> list:
    """`prompts` added at once and served to the end: their finished outputs; `watch(engine)` after each step."""
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if watch is not None:
            watch(engine)
    return [done[i] for i in ids]


def _check_pool(engine: LLMEngine) -> None:
    """Every kept window block is kept for a named block, once; unreferenced ones are parked; none is
    also free."""
    pool, cache = engine.blocks.window, engine.blocks.cache
    assert set(pool.kept) <= set(cache.hash_of)
    assert {w: b for b, w in pool.kept.items()} == pool.kept_for
    assert set(pool.parked) == {w for w in pool.kept_for if pool.ref[w] == 0}
    assert not set(pool.free) & set(pool.kept_for)
    assert len(pool.free) + sum(1 for r in pool.ref if r) + len(pool.parked) == pool.num_blocks


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "llama4_text"])
def test_a_prefix_longer_than_the_window_is_taken_from_the_cache(family, tmp_path):
    """A second request sharing 26 tokens (five windows) with the first takes its 6 full blocks from
    the cache, the windowed layers' from the blocks kept with them, and decodes transformers' tokens;
    the first served again hits all of its full blocks."""
    hf = write_model(tmp_path, family, std=0.25)
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, max_num_batched_tokens=8))
    assert engine.blocks.window is not None and engine.blocks.cache is not None
    first, second = SHARED + [60, 61, 62], SHARED + [1, 90, 4, 33, 70]
    outs = [_serve(engine, [p], lambda e: _check_pool(e))[0] for p in (first, second, first)]
    assert [o.cached_tokens for o in outs] == [0, 24, 28]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in (first, second, first)]
    pool = engine.blocks.window
    assert pool.num_free_blocks == pool.num_blocks and len(pool.parked) > 0


def test_interleaved_requests_with_different_prefixes_never_share_window_blocks(tmp_path):
    """A and B share their first block only; each is seeded, then a continuation of each runs beside
    the other's: each hits its own prefix, the two never hold the same window block, each held block
    kept is the one kept for its own full block of the same positions, and both decode what
    transformers does."""
    hf = write_model(tmp_path, "gemma3_text", std=0.25)
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=4))
    pool = engine.blocks.window
    a, b = SHARED[:20], SHARED[:4] + [70 + i for i in range(16)]
    seeds = _serve(engine, [a + [5], b + [6]])
    shared_steps = []

    def watch(e):
        _check_pool(e)
        running = e.scheduler.running
        for seq in running:
            for i, w in enumerate(seq.window_table):
                if w != pool.released and seq.block_table[i] in pool.kept:
                    assert pool.kept[seq.block_table[i]] == w
        if len(running) == 2:
            shared_steps.append(set(pool.held(running[0])) & set(pool.held(running[1])))

    conts = [a + [9, 10, 11], b + [12, 13, 14, 15, 16]]
    outs = _serve(engine, conts, watch)
    assert [o.cached_tokens for o in outs] == [20, 20]
    assert shared_steps and not any(shared_steps)
    assert [o.token_ids for o in seeds + outs] == [hf_greedy(hf, p, 6) for p in [a + [5], b + [6], *conts]]


def test_window_blocks_evicted_from_a_small_pool_cut_a_hit_back(tmp_path):
    """One sequence at a time: a pool of 5 window blocks keeps only the last ones a request gave back.
    The first request's prefix is evicted by the second's, so the third request's repeat of it finds
    its full blocks still named but its window blocks gone: the hit is cut back to none. Recomputing
    them keeps its window blocks with the named full blocks again, so a fourth request hits them; all
    decode transformers' tokens, and nothing leaks."""
    hf = write_model(tmp_path, "gpt_oss", std=0.25)
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=1))
    pool, blocks = engine.blocks.window, engine.blocks
    assert pool.num_blocks == 3 + 2  # a decoding window's blocks and a prompt chunk's
    other = [(11 * i + 5) % 90 + 5 for i in range(30)]
    prompts = [SHARED + [60], other, SHARED + [61], SHARED + [62]]
    outs = []
    for p in prompts:
        outs.append(_serve(engine, [p], _check_pool)[0])
        if len(outs) == 3:
            assert len(blocks.cache.lookup(hash_chain(SHARED, 4))) == 6  # the full blocks are still named
    assert [o.cached_tokens for o in outs] == [0, 0, 0, 24]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert pool.num_free_blocks == pool.num_blocks and len(pool.kept) <= pool.num_blocks


def test_a_system_prompt_is_pinned_and_its_window_blocks_kept(tmp_path):
    """A system prompt of 26 characters warmed at start: its full blocks pinned, the window blocks its
    end sees kept with them, so a request starting with it takes those blocks from the cache and
    decodes transformers' tokens."""
    hf = write_model(tmp_path, "gemma3_text", std=0.25)
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, max_num_batched_tokens=8))
    system = "you are a tiny test model."
    engine.warm_system_prompts([system])
    full = len(engine.tokenizer.encode(system)) // 4
    assert full >= 6 and engine.blocks.num_pinned_blocks == full  # five windows and more
    prompt = engine.tokenizer.encode(system + " hello")
    out = _serve(engine, [prompt], _check_pool)[0]
    assert out.cached_tokens == 4 * full
    assert out.token_ids == hf_greedy(hf, prompt, 6)


def test_preempted_requests_sharing_a_prefix_come_back_from_the_cache(tmp_path):
    """Too few full blocks for four requests at once: preempted ones are admitted again, finding their
    prefix (their own blocks or another's, full and windowed) in the cache, and decode transformers'
    tokens."""
    hf = write_model(tmp_path, "gpt_oss", std=0.25)
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, num_blocks=16, max_model_len=40, max_num_seqs=4))
    prompts = [SHARED[:13] + [i + 1, 2 * i + 3] for i in range(4)]
    outs = _serve(engine, prompts, _check_pool)
    assert engine.metrics.preemptions > 0 and engine.blocks.cache.hit_tokens > 0
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_the_benchmark_serves_the_same_tokens_with_and_without_the_cache(capsys):
    """bench/windowed_prefix_cache.py on a small case: with the windowed pool's prefix caching, without
    it and with every block kept, the same tokens; the second request's shared 64 tokens come from the
    cache in both caching modes."""
    import json

    from bench.windowed_prefix_cache import main

    assert main(["--prefix", "64", "--tail", "4", "--requests", "2", "--max-tokens", "2", "--window", "16",
                 "--dim", "32"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]
    assert report["same_tokens"]
    modes = ("bounded_cached", "bounded_uncached", "kept_cached")
    assert [runs[k]["cached_prompt_tokens"] for k in modes] == [64, 0, 64]
    assert runs["bounded_cached"]["computed_prompt_tokens"] == 2 * 68 - 64


def test_the_server_reports_the_hit_in_usage(tmp_path):
    """Over HTTP: the second completion sharing a prompt start five windows long reports the shared
    full blocks as cached tokens in its usage (and in /metrics), and its text is transformers'."""
    hf = write_model(tmp_path, "gemma3_text", std=0.25)
    tok = Tokenizer.from_path(tmp_path)
    start = "a shared start, five windows long: "
    prompts = [start + "one", start + "and another"]
    ids = [tok.encode(p) for p in prompts]
    shared = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y) // 4 * 4
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, max_num_batched_tokens=8))
    with RunningServer(engine) as server:
        bodies = [httpx.post(server.url + "/v1/completions", timeout=HANG_S,
                             json={"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0,
                                   "ignore_eos": True}).json() for p in prompts]
        assert prefix_hit_tokens(server.url) == shared
    assert shared >= 24 and [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies] == [0, shared]
    assert [b["choices"][0]["text"] for b in bodies] == [tok.decode(hf_greedy(hf, i, 6)) for i in ids]


@pytest.mark.dist
@pytest.mark.slow
def test_two_tensor_parallel_ranks_share_a_prefix_with_kept_window_blocks(tmp_path):
    """tp=2: both ranks serve from the windowed pool, the second request's 24 shared tokens come from
    the cache, and both decode transformers' tokens."""
    hf = write_model(tmp_path, "gpt_oss", std=0.25)
    first, second = SHARED + [60, 61, 62], SHARED + [1, 90, 4]
    with LLM(tmp_path, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=8) as two:
        outs = [_serve(two.engine, [p], _check_pool)[0] for p in (first, second)]
        assert two.engine.blocks.window is not None
    assert [o.cached_tokens for o in outs] == [0, 24]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in (first, second)]


def test_the_ring_takes_a_fresh_block_rather_than_write_over_a_kept_one(tmp_path):
    """A request decoding many windows past a short prompt: every full block it decodes is named, so
    each time its ring comes round to a block, that block is kept, and the ring takes a fresh one.
    Each kept block's keys stay what they were when it was kept, while it is kept; a sequence holds
    its ring and at most one block it turned away from (the rest are parked, the cache's); and a
    second request repeating the whole first sequence hits its blocks and decodes transformers' tokens
    (the kept blocks written over, its keys would be the later positions')."""
    hf = write_model(tmp_path, "gemma3_text", std=0.25)
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=1))
    pool, kv = engine.blocks.window, engine.kv
    layer = min(pool.layers.layers)
    seen: dict[tuple[int, int], torch.Tensor] = {}  # (full block, kept window block) -> its keys when first seen
    most = []

    def watch(e):
        _check_pool(e)
        for pair in [p for p in seen if pool.kept.get(p[0]) != p[1]]:
            del seen[pair]
        for pair in pool.kept.items():
            keys = kv.k[layer][pair[1] * 4:(pair[1] + 1) * 4].clone()
            assert torch.equal(seen.setdefault(pair, keys), keys)  # never written while kept
        most.extend(len(pool.held(s)) for s in e.scheduler.running)

    prompt = SHARED[:6]
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt, long)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        watch(engine)
    first = prompt + done[rid].token_ids
    assert first == prompt + hf_greedy(hf, prompt, 30)
    assert max(most) <= pool.ring + 1 and len(pool.parked) >= pool.ring
    again = first + [9, 8]
    out = _serve(engine, [again], watch)[0]
    assert out.cached_tokens == (len(first) - 1) // 4 * 4  # its last token was sampled, never computed
    assert out.token_ids == hf_greedy(hf, again, 6)
