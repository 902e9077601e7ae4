"""Sliding-window and chunked layers keep a ring of their window's token slots (`--windowed-kv bounded`,
tessera/infer/scheduling/window_blocks.py, tessera/infer/runner/window_ring.py): a sequence many
windows long holds at most ceil(window / block) blocks in the windowed layers' pool, prompt chunks
included, while the full layers keep all of theirs, and decodes the tokens transformers does (Gemma
3's local layers, gpt-oss's with sinks, Llama 4's chunks), with prompt chunks that do not divide the
window and two requests batched; a finished request's ring serves the next; rejected speculative
drafts overwrite nothing a later query sees; preemption, speculative drafts, the static-shape decode
step, perplexity and loglikelihood scoring give what the engine that keeps every block gives; a
request failing on inf/NaN leaves its window blocks to be zeroed in the windowed layers; in float64
(EngineConfig.fp64_attention) the wrapping chunks score as keeping every block, to the bit. The tests of
the ring's holding run without prefix caching (with it, kept blocks: test_windowed_prefix_cache.py);
the others run with it, the default."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tessera.config import get_preset
from tessera.config.errors import ConfigError
from tessera.eval.scoring import ScoreRequest, score_requests
from tessera.infer import LLM, SamplingParams
from tessera.infer.config import SpeculativeConfig
from tessera.infer.engine.perplexity import paged_nll
from tessera.infer.engine.sequence import Sequence
from tessera.infer.runner.bucketed_decode import DecodeRow, _Bucket
from tessera.infer.runner.paged_model import BatchItem
from tessera.infer.scheduling.block_manager import BlockManager
from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.infer.scheduling.scheduler import Scheduler
from tessera.infer.scheduling.window_blocks import WindowedLayers, WindowPool
from tests.infer.tiny_models import hf_greedy, write_model

PROMPTS = ["a window of five sees little", "hi", "the second one, a little longer than the first"]


def _run(llm: LLM, prompts: list[str], max_tokens: int, watch=None) -> list[list[int]]:
    """Greedy completions of `prompts`, stepping the engine by hand; `watch(engine)` after each step."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.scheduler.requests[engine.add_request(llm.encode(p), params)] for p in prompts]
    while engine.has_unfinished():
        engine.step()
        if watch is not None:
            watch(engine)
    return [s.output_ids for s in seqs]


def _expected(hf, llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    return [hf_greedy(hf, llm.encode(p), max_tokens) for p in prompts]


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "llama4_text"])
def test_a_sequence_many_windows_long_holds_one_window_of_blocks(family, tmp_path):
    """Windows (or chunks) of 5 on layer 0, blocks of 4, prompt chunks of 8: after every step a
    sequence, prefilling or decoding, holds at most ceil(5 / 4) blocks of the windowed pool (its
    ring, which its window table repeats), while its full-attention table covers every position
    (10+ windows)."""
    hf = write_model(tmp_path, family, std=0.25)
    llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False)  # the ring alone
    blocks = llm.engine.blocks
    pool = blocks.window
    assert pool is not None and pool.layers.layers == {0}
    bound = pool.layers.blocks_per_seq(4)
    assert bound == pool.ring == 2
    seen = {"decode": 0, "prefill": 0, "longest": 0}

    def watch(engine):
        for seq in engine.scheduler.running:
            held = len(pool.held(seq))
            assert len(seq.block_table) == len(seq.window_table) == blocks.blocks_for(seq.num_computed)
            phase = "decode" if seq.output_ids else "prefill"
            seen[phase] = max(seen[phase], held)
            table = seq.window_table
            assert all(table[i] == table[i - bound] for i in range(bound, len(table)))
            seen["longest"] = max(seen["longest"], seq.num_computed)
        assert pool.num_used_blocks == sum(len(pool.held(s)) for s in engine.scheduler.running)

    outs = _run(llm, PROMPTS, 40, watch)
    assert outs == _expected(hf, llm, PROMPTS, 40)
    assert 0 < seen["decode"] <= bound and seen["prefill"] <= bound
    assert seen["longest"] >= 10 * 5  # ten windows and more
    assert pool.num_free_blocks == pool.num_blocks and blocks.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize(("family", "attention", "chunk"), [("gemma3_text", "kernel", 6), ("gpt_oss", "kernel", 6),
                                                            ("gemma3_text", "torch", 6), ("gpt_oss", "torch", 20)])
def test_a_window_of_whole_blocks_holds_exactly_its_blocks_batched(family, attention, chunk, tmp_path, monkeypatch):
    """A window of 8 = two blocks of 4, prompt chunks of 6 or 20 (neither divides it; 20 is longer
    than the ring, so a chunk overwrites its own first keys), two requests batched: each holds at most
    8 / 4 blocks (the ring has no slot to spare), the chunks past the ring's first turn attend to their
    own keys from the step's tensors, and both requests decode transformers' tokens, with the CPU
    kernel reading the ring in place and without it (SDPA over the gathered ring:
    TESSERA_CPU_ATTENTION=torch)."""
    from tessera.infer.runner.window_ring import WindowRingBatch

    if attention == "torch":
        monkeypatch.setenv("TESSERA_CPU_ATTENTION", "torch")
    hf = write_model(tmp_path, family, std=0.25, sliding_window=8)
    llm = LLM(tmp_path, block_size=4, max_num_seqs=2, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    pool = llm.engine.blocks.window
    assert pool.ring == 2 and pool.num_blocks == 2 * 2 and llm.engine.kv.window_ring == 8
    wrapped, most = [], []
    real = WindowRingBatch._attend_wrapping
    monkeypatch.setattr(WindowRingBatch, "_attend_wrapping",
                        lambda self, layer, w, *a: wrapped.append(w.rows) or real(self, layer, w, *a))

    def watch(engine):
        most.append(max((len(set(pool.held(s))) for s in engine.scheduler.running), default=0))
        assert pool.num_used_blocks == sum(len(pool.held(s)) for s in engine.scheduler.running)

    prompts = [PROMPTS[0] + " and more than a window", PROMPTS[2]]
    outs = _run(llm, prompts, 30, watch)
    assert outs == _expected(hf, llm, prompts, 30)
    assert max(most) == 2 and wrapped


def test_a_finished_requests_ring_serves_the_next(tmp_path):
    """Three requests of 12+ blocks each through two sequence slots and a windowed pool of 2 x 2
    blocks: the third takes the ring of one that finished, and all decode transformers' tokens."""
    hf = write_model(tmp_path, "gemma3_text", std=0.25)
    llm = LLM(tmp_path, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, enable_prefix_caching=False)
    pool = llm.engine.blocks.window
    holders = defaultdict(set)

    def watch(engine):
        for seq in engine.scheduler.running:
            for b in pool.held(seq):
                holders[b].add(seq.request_id)

    outs = _run(llm, PROMPTS, 40, watch)
    assert outs == _expected(hf, llm, PROMPTS, 40)
    assert pool.num_blocks == 4
    assert any(len(ids) == 2 for ids in holders.values())


def test_preempted_requests_decode_the_same(tmp_path):
    hf = write_model(tmp_path, "gpt_oss", std=0.25)
    llm = LLM(tmp_path, block_size=4, num_blocks=24, max_model_len=64, max_num_seqs=8)
    prompts = [f"prompt number {i} is here" for i in range(5)]
    outs = _run(llm, prompts, 24)
    assert llm.engine.metrics.preemptions > 0
    assert outs == _expected(hf, llm, prompts, 24)
    blocks = llm.engine.blocks
    assert len(blocks.free) + len(blocks.cache.evictable) == 24  # with prefix caching: free or cached
    assert blocks.window.num_free_blocks == blocks.window.num_blocks


def test_speculative_drafts_over_a_windowed_pool(tmp_path):
    """The target as its own draft (every proposal accepted): three speculative slots a step, still
    at most the window's blocks and those slots' held."""
    hf = write_model(tmp_path, "gemma3_text", std=0.25)
    llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=16,
              speculative=SpeculativeConfig(method="draft", num_tokens=3, draft_model=str(tmp_path)))
    pool = llm.engine.blocks.window
    most = []
    outs = _run(llm, PROMPTS[:2], 40, lambda e: most.extend(len(pool.held(s)) for s in e.scheduler.running))
    assert outs == _expected(hf, llm, PROMPTS[:2], 40)
    assert llm.engine.metrics.spec_proposed > 0
    assert max(most) <= pool.layers.blocks_per_seq(4, lookahead=3)


def test_rejected_drafts_leave_the_ring_as_it_must_be(tmp_path):
    """A draft model of the target's random draws at a smaller scale (some proposals accepted, others
    rejected), a window of 8 in blocks of 4 and three speculative slots: the ring has the window's
    blocks plus the slots' (8 + 3 -> 3 blocks), so the verified step's keys of rejected drafts
    overwrote only keys no later query sees, and the tokens are transformers'."""
    hf = write_model(tmp_path / "target", "gemma3_text", std=0.25, sliding_window=8)
    write_model(tmp_path / "draft", "gemma3_text", std=0.15, sliding_window=8)  # the same draws, scaled
    llm = LLM(tmp_path / "target", block_size=4, max_num_batched_tokens=6, enable_prefix_caching=False,
              speculative=SpeculativeConfig(method="draft", num_tokens=3, draft_model=str(tmp_path / "draft")))
    pool = llm.engine.blocks.window  # the ring alone (prefix caching would take fresh blocks for kept ones)
    assert pool.ring == 3
    outs = _run(llm, PROMPTS[:2], 40, lambda e: [len(pool.held(s)) <= 3 or pytest.fail("ring grew")
                                                 for s in e.scheduler.running])
    assert outs == _expected(hf, llm, PROMPTS[:2], 40)
    metrics = llm.engine.metrics
    assert 0 < metrics.spec_accepted < metrics.spec_proposed


def test_scoring_over_a_windowed_pool_equals_keeping_every_block(tmp_path):
    """Perplexity (a text of three max_model_len windows) and loglikelihood requests (the borrowed
    cache, piece by piece) give what the engine that keeps every block gives; `kept` has no windowed
    pool, and KV tiers ask for it."""
    write_model(tmp_path, "gemma3_text", std=0.25)
    ids = list(range(3, 70))
    got = {}
    for mode in ("bounded", "kept"):
        llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=8, max_model_len=32, windowed_kv=mode)
        assert (llm.engine.blocks.window is None) == (mode == "kept")
        got[mode] = (paged_nll(llm.engine, ids, chunk=8),
                     score_requests(llm.engine, [ScoreRequest(ids[:30], 9), ScoreRequest(ids[10:43], 20)]))
    (nll_b, n_b), scores_b = got["bounded"]
    (nll_k, n_k), scores_k = got["kept"]
    assert n_b == n_k and nll_b == pytest.approx(nll_k, rel=1e-5)
    for (lp_b, greedy_b), (lp_k, greedy_k) in zip(scores_b, scores_k, strict=True):
        assert lp_b == pytest.approx(lp_k, rel=1e-5) and greedy_b == greedy_k
    with pytest.raises(ConfigError, match="windowed_kv='bounded' is invalid: 'kept' with KV tiers"):
        LLM(tmp_path, block_size=4, kv_offload_gib=0.01)


def test_scoring_pieces_longer_than_the_ring_reuse_it_with_prefix_caching_on(tmp_path):
    """Scoring names no block, so even with prefix caching on its pieces (16 tokens, the ring 8 slots)
    reuse the ring rather than take a block per block: a text of 64 tokens is scored through a
    windowed pool of 7 blocks, as the engine keeping every block scores it, and gives them all back."""
    write_model(tmp_path, "gemma3_text", std=0.25)
    ids = list(range(3, 67))
    got = {}
    for mode in ("bounded", "kept"):
        llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=16, max_num_seqs=1, max_model_len=64,
                  windowed_kv=mode)
        got[mode] = paged_nll(llm.engine, ids, chunk=16)
        pool = llm.engine.blocks.window
        if pool is not None:
            assert pool.caching and pool.num_blocks == 2 + 1 + 4
            assert pool.num_free_blocks == pool.num_blocks
    assert got["bounded"][1] == got["kept"][1] and got["bounded"][0] == pytest.approx(got["kept"][0], rel=1e-5)


def test_the_static_decode_step_reads_the_window_tables(tmp_path):
    """Mid-decode, past the rings' first turn: the decode step's padded block-table attention (the CUDA
    graph's, run eagerly here) and its ragged CPU rows equal the packed step, and NaN in every
    windowed block no table holds changes nothing."""
    write_model(tmp_path, "gemma3_text", std=0.25)
    llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    seqs = [engine.scheduler.requests[engine.add_request(llm.encode(p), params)] for p in PROMPTS]
    while min(s.num_computed for s in seqs) < 36:
        engine.step()
    pool, kv = engine.blocks.window, engine.kv
    for s in seqs:
        assert engine.blocks.ensure_slots(s, s.num_computed + 1)
        table, ring = s.window_table, pool.ring  # past its first turn: the ring's blocks again, or a
        assert len(table) > ring  # fresh one where the prefix cache keeps the block of the last turn
        assert all(table[i] == table[i - ring] or table[i - ring] in (pool.released, *pool.kept_for)
                   for i in range(ring, len(table)))
    free = torch.tensor(list(pool.free) + list(pool.parked))  # parked: kept for the prefix cache, held by no table
    slots = (free[:, None] * 4 + torch.arange(4)).flatten()
    for layer in pool.layers.layers:
        kv.k[layer][slots] = float("nan")
        kv.v[layer][slots] = float("nan")
    tokens = [s.token_ids[s.num_computed] for s in seqs]
    items = [BatchItem([t], s.num_computed, s.block_table, window_table=s.window_table) for t, s in zip(tokens, seqs)]
    rows = [DecodeRow(t, s.num_computed, s.block_table, window_table=s.window_table) for t, s in zip(tokens, seqs)]
    want = engine.executor.local.forward(items)
    decoder = engine.decoder
    ragged = decoder.forward(rows)
    MB = max(len(s.block_table) for s in seqs)
    decoder._fill(rows, 4, MB)
    padded = _Bucket(decoder, 4, MB).run(decoder.model)  # a padding row too
    assert torch.isfinite(want).all()
    torch.testing.assert_close(ragged, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[:3], want, rtol=1e-5, atol=1e-5)


def test_clearing_a_failed_requests_blocks_reaches_each_pool():
    """-1 - b names block b of the windowed pool (how a request failing on inf/NaN hands its window
    blocks to be zeroed): zeroed in the windowed layers only, b >= 0 in the full layers only."""
    cfg = get_preset("tiny-llama", n_layers=2, sliding_window=4, window_layers=[0])
    kv = PagedKVCache(cfg, 6, 4, torch.float32, window_layers=frozenset({0}), window_blocks=3)
    assert kv.k[0].shape[0] == 3 * 4 and kv.k[1].shape[0] == 6 * 4
    for store in (*kv.k, *kv.v):
        store.fill_(float("nan"))
    kv.clear_blocks([-1 - 2, 5])
    for store in (kv.k[0], kv.v[0]):
        blocks = store.view(3, -1)
        assert blocks[2].eq(0).all() and blocks[:2].isnan().all()
    for store in (kv.k[1], kv.v[1]):
        blocks = store.view(6, -1)
        assert blocks[5].eq(0).all() and blocks[:5].isnan().all()


def test_a_request_failing_on_nan_leaves_its_window_blocks_to_be_zeroed():
    cfg = get_preset("tiny-llama", n_layers=2, sliding_window=4, window_layers=[0], max_seq_len=64)
    pool = WindowPool(8, 4, WindowedLayers.of(cfg, 64))
    blocks = BlockManager(16, 4, enable_prefix_caching=False, window=pool)
    scheduler = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=32)
    seq = Sequence("r", list(range(3, 13)), SamplingParams(max_tokens=4), None)
    scheduler.add(seq)
    scheduler.schedule()
    held, own = pool.held(seq), list(seq.block_table)
    assert len(held) == 1 and pool.num_free_blocks == 7  # a window of 4: a ring of one block
    scheduler._fail_alone(seq, FloatingPointError("inf"))
    assert sorted(scheduler.take_dirty_blocks()) == sorted(own + [-1 - b for b in held])
    assert pool.num_free_blocks == 8 and blocks.num_free_blocks == 8


@pytest.mark.parametrize("mode", ["bounded", "kept"])
def test_generate_and_eval_take_the_windowed_kv_option(mode, tmp_path, capsys):
    """`tessera generate --windowed-kv MODE` decodes what transformers does either way, and `tessera
    eval` hands the option to its engine; a value outside the two is refused with exit 2."""
    import argparse

    from tessera.cli import eval as eval_cli
    from tessera.cli import main
    from tests.infer.tiny_models import char_tokenizer

    hf = write_model(tmp_path, "gemma3_text", std=0.25)
    prompt = "longer than a window of five"
    assert main(["generate", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "12", "--windowed-kv", mode]) == 0
    tok = char_tokenizer()
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert capsys.readouterr().out.strip() == prompt + tok.decode(hf_greedy(hf, ids, 12), skip_special_tokens=True)
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--tasks", "loss", "--windowed-kv", mode])
    assert eval_cli._settings(args).engine["windowed_kv"] == mode
    with pytest.raises(SystemExit) as refused:
        main(["generate", str(tmp_path), "--prompt", prompt, "--windowed-kv", "ring"])
    assert refused.value.code == 2 and "choose from 'bounded', 'kept'" in capsys.readouterr().err


def test_in_float64_the_wrapping_chunks_score_as_keeping_every_block(tmp_path, monkeypatch):
    """EngineConfig.fp64_attention (GRPO's engine): the ring's rows, those that attend through the
    window tables and the prompt chunks past the ring's first turn (window_ring.py's own SDPA), attend
    in float64 and round back as the engine keeping every block does, so the log-probabilities of the
    same greedy tokens are equal to the bit (window 8 = two blocks of 4, prompt chunks of 20)."""
    from tessera.infer.runner.window_ring import WindowRingBatch

    write_model(tmp_path, "gemma3_text", std=0.25, sliding_window=8)
    wrapped = []
    real = WindowRingBatch._attend_wrapping
    monkeypatch.setattr(WindowRingBatch, "_attend_wrapping",
                        lambda self, layer, w, *a: wrapped.append(w.rows) or real(self, layer, w, *a))
    got = {}
    for mode in ("bounded", "kept"):
        llm = LLM(tmp_path, block_size=4, max_num_seqs=2, max_num_batched_tokens=20, windowed_kv=mode,
                  fp64_attention=True)
        assert llm.engine.kv.attention_dtype == torch.float64
        engine, params = llm.engine, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
        seqs = [engine.scheduler.requests[engine.add_request(llm.encode(p), params)]
                for p in (PROMPTS[0] + " and more than a window", PROMPTS[2])]
        while engine.has_unfinished():
            engine.step()
        got[mode] = [(s.output_ids, [lp.logprob for lp in s.logprobs]) for s in seqs]
    assert wrapped and got["bounded"] == got["kept"]
