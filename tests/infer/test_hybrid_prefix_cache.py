"""Prefix caching for hybrid models (infer/scheduling/state_snapshots.py): the engine keeps a snapshot
of the recurrent state at block boundaries (every block here, by default every DeltaNet chunk) beside
the block, so a request whose prompt starts
with cached blocks skips them and starts its slot from the snapshot at their end. Proved against
transformers: a second request sharing a prefix reports cached prompt tokens and decodes
transformers' greedy tokens (prompt chunks cut across block boundaries, for Qwen3-Next, Qwen3.5 MoE
and Nemotron-H, whose Mamba-2 layers' states are snapshotted as the DeltaNet layers' are); requests
with different prefixes interleaved with each other, each hitting its own earlier
prefix, decode what each does alone; snapshots are paid from the KV budget and go when their blocks
are evicted, after which the cache still serves the right tokens; preempted requests come back from
snapshots."""

import pytest
import torch

from tessera.config import ConfigError, get_preset
from tessera.infer import EngineConfig, LLMEngine, SamplingParams
from tessera.infer.runner.paged_model import cache_geometry
from tessera.infer.scheduling.kv_cache import bytes_per_block
from tessera.infer.scheduling.recurrent_state import bytes_per_slot
from tests.infer.tiny_models import hf_greedy
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHARED = [3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8, 17]  # 3 full blocks of 4, and 2 more tokens


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe_text", "nemotron_h"])
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf = random_hf_model(hf_configs()[request.param], seed=3, std=0.2)
    hf.save_pretrained(path)
    return path, hf


def _run(engine: LLMEngine, prompt: list[int]):
    """`prompt` served alone to the end: its finished output."""
    engine.add_request(prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done = out
    return done


def test_a_shared_prefix_is_taken_from_the_cache_and_decodes_transformers_tokens(hybrid):
    path, hf = hybrid
    first, second = SHARED + [60, 61, 62], SHARED + [1, 90, 4, 33, 70]
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, max_num_batched_tokens=6, state_snapshot_tokens=4))
    out_first, out_second, again = (_run(engine, p) for p in (first, second, first))
    assert out_first.cached_tokens == 0
    assert out_second.cached_tokens == 12 and again.cached_tokens == 16  # whole blocks, up to the last snapshot
    assert [out_first.token_ids, out_second.token_ids] == [hf_greedy(hf, p, 6) for p in (first, second)]
    assert again.token_ids == out_first.token_ids
    assert engine.blocks.cache.hit_tokens == 28


def test_by_default_snapshots_fall_where_the_chunked_form_cuts_a_prompt(hybrid):
    """Snapshots every chunk of the recurrent layers' chunked form (the DeltaNet chunk, 64 tokens: 16
    blocks of 4; the test Nemotron-H's Mamba-2 chunk, 4 tokens: one block): a prompt sharing 68 tokens
    with a cached one takes the whole chunks of them from the cache, and decodes transformers' tokens."""
    path, hf = hybrid
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4))
    first = [(7 * i + 3) % 90 for i in range(70)]
    second = first[:68] + [1, 2, 3]
    outs = [_run(engine, p) for p in (first, second)]
    every = 4 if engine.cfg.mamba is not None else 64
    assert engine.runner.snapshots.every == every and [o.cached_tokens for o in outs] == [0, 68 // every * every]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in (first, second)]
    with pytest.raises(ConfigError, match=r"state_snapshot_tokens=6 is invalid: must be None or a positive multiple "
                                          r"of block_size=4"):
        EngineConfig(block_size=4, state_snapshot_tokens=6)


def test_interleaved_requests_with_different_prefixes_never_share_a_state(hybrid):
    """A and B share their first block only; each is seeded in the cache, then a continuation of each
    runs beside the other's, step by step: each hits its own prefix and decodes what it does alone."""
    path, hf = hybrid
    a, b = SHARED[:12], SHARED[:4] + [70, 71, 72, 73, 74, 75, 76, 77]
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                                                   state_snapshot_tokens=4))
    prompts = [a + [5], b + [6], a + [9, 10, 11], b + [12, 13, 14, 15, 16]]
    done, ids = {}, []
    for i, prompt in enumerate(prompts):
        ids.append(engine.add_request(prompt, GREEDY))
        if i % 2:  # the seeds run first; the continuations join while each other's tokens decode
            while engine.has_unfinished():
                done.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    outs = [done[i] for i in ids]
    assert [o.cached_tokens for o in outs[2:]] == [12, 12]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_snapshots_are_paid_from_the_kv_budget_and_go_with_their_blocks(hybrid):
    path, hf = hybrid
    cfg = get_preset("tiny-qwen3-next")
    config = EngineConfig(kv_cache_gib=0.0002, max_num_seqs=2, block_size=4)
    geometry = cache_geometry(cfg, config)
    per_slot, per_block = bytes_per_slot(cfg, torch.float32), bytes_per_block(cfg, 4, torch.float32, False)
    left = int(0.0002 * 2**30) - 2 * per_slot
    assert geometry.num_snapshots == left // 2 // per_slot > 0
    assert geometry.num_blocks == (left - geometry.num_snapshots * per_slot) // per_block
    off = cache_geometry(cfg, EngineConfig(kv_cache_gib=0.0002, max_num_seqs=2, block_size=4,
                                           enable_prefix_caching=False))
    assert off.num_snapshots == 0 and off.num_blocks > geometry.num_blocks

    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, num_blocks=12, max_num_seqs=1, max_model_len=40,
                                                   state_snapshot_tokens=4))
    prompts = [[i + 1] * 4 + SHARED[:12] for i in range(4)] + [[1] * 4 + SHARED[:12]]
    outs = [_run(engine, p) for p in prompts]
    blocks, snapshots = engine.blocks, engine.runner.snapshots
    assert snapshots.taken > len(snapshots.of_block)  # some went with evicted blocks
    assert set(snapshots.of_block) <= set(blocks.cache.hash_of)  # none outlives its block's name
    assert len(snapshots.free) + len(snapshots.of_block) == snapshots.num_snapshots
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_preempted_requests_sharing_a_prefix_come_back_from_snapshots(hybrid):
    """Too few blocks for four requests at once: preempted ones are admitted again, finding their
    prefix (their own blocks or another's) in the cache, and still decode transformers' tokens."""
    path, hf = hybrid
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, num_blocks=12, max_model_len=40, max_num_seqs=4,
                                                   state_snapshot_tokens=4))
    prompts = [SHARED[:9] + [i + 1, 2 * i + 3] for i in range(4)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert engine.metrics.preemptions > 0 and engine.blocks.cache.hit_tokens > 0
    assert [done[i] for i in ids] == [hf_greedy(hf, p, 6) for p in prompts]


def test_the_benchmark_serves_the_same_tokens_with_and_without_the_cache(capsys):
    """bench/hybrid_prefix_cache.py on a small case: what it times with prefix caching computes the
    tokens it computes without, the later requests' shared blocks coming from the cache."""
    import json

    from bench.hybrid_prefix_cache import main

    assert main(["--prefix", "130", "--tail", "5", "--requests", "3", "--dim", "64", "--layers", "4"]) == 0
    report = json.loads(capsys.readouterr().out)  # blocks of 16, snapshots every 64 tokens (the chunk)
    assert report["same_tokens"] and report["with_cache"]["cached_prompt_tokens"] == 2 * 128
    assert report["without_cache"]["cached_prompt_tokens"] == 0
