"""Paged KV bookkeeping and the prefix cache: reference counts, hash chains, LRU eviction of
unreferenced cached blocks, pinning, and the scheduler's token budget, preemption and queue order."""

import pytest

from tessera.config.errors import ConfigError
from tessera.infer import EngineConfig
from tessera.infer.engine.sequence import Sequence
from tessera.infer.sampling.params import SamplingParams
from tessera.infer.scheduling.block_manager import BlockManager
from tessera.infer.scheduling.prefix_cache import hash_chain
from tessera.infer.scheduling.scheduler import Scheduler


def seq(rid: str, tokens: list[int], adapter_key: bytes = b"") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), None, adapter_key=adapter_key)


def test_hash_chain_names_prefixes_and_adapters():
    a = hash_chain(list(range(10)), 4)
    b = hash_chain(list(range(8)) + [99, 99], 4)
    c = hash_chain([7] + list(range(1, 10)), 4)
    assert len(a) == 2 and a == b  # only full blocks, same prefix -> same names
    assert c[0] != a[0] and c[1] != a[1]  # block 1's name depends on block 0
    assert hash_chain(list(range(10)), 4, adapter_key=b"lora#1") != a


def test_shared_prefix_blocks_are_reused_refcounted_and_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    s1 = seq("1", list(range(9)))  # 2 full blocks + 1 token
    assert bm.find_prefix(s1)[0] == []  # empty cache
    assert bm.ensure_slots(s1, 9) and len(s1.block_table) == 3
    s1.num_computed = 9
    bm.register_computed(s1)
    assert len(bm.cache) == 2
    s2 = seq("2", list(range(8)) + [50, 51])
    hit, hashes = bm.find_prefix(s2)
    assert hit == s1.block_table[:2]
    bm.adopt_prefix(s2, hit, hashes)
    assert s2.num_computed == 8 and bm.ref[hit[0]] == 2
    bm.free_sequence(s1)
    assert bm.ref[hit[0]] == 1 and bm.num_free_blocks == 6 - 2  # s1's tail block went back to the pool
    bm.free_sequence(s2)
    assert bm.num_free_blocks == 6 and len(bm.cache) == 2  # still cached, now evictable
    # a whole-prompt hit still leaves the last token to compute
    s3 = seq("3", list(range(8)))
    hit, _ = bm.find_prefix(s3)
    assert len(hit) == 1
    # filling the pool evicts the least recently used cached block first: s1/s2 released the tail
    # block (index 1) before the head (index 0), so the head survives longest
    s4 = seq("4", [90] * 20)
    assert bm.ensure_slots(s4, 20)  # 5 blocks: 4 free + evict one
    assert len(bm.cache) == 1 and bm.find_prefix(s3)[0] == hit
    assert not bm.ensure_slots(seq("5", [1] * 8), 8)  # 1 evictable left, 2 needed: refused, nothing taken
    assert bm.num_free_blocks == 1


def test_pinned_blocks_are_never_evicted():
    bm = BlockManager(num_blocks=4, block_size=2)
    s = seq("sys", [1, 2, 3, 4, 5])
    bm.ensure_slots(s, 5)
    s.num_computed = 5
    bm.register_computed(s)
    assert bm.pin_sequence(s) == 2
    bm.free_sequence(s)
    assert bm.num_free_blocks == 2 and bm.num_pinned_blocks == 2
    other = seq("o", [9] * 6)
    assert not bm.ensure_slots(other, 6)
    hit, _ = bm.find_prefix(seq("u", [1, 2, 3, 4, 7, 7]))
    assert len(hit) == 2


def test_scheduler_budget_chunks_prefill_and_preempts_newest():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=10, policy="fcfs")
    a, b = seq("a", list(range(14))), seq("b", list(range(6)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 10)]
    a.num_computed += 10
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 4), ("b", 6)]
    assert out.scheduled[0].completes and out.scheduled[1].completes
    a.num_computed, b.num_computed = 14, 6
    # both decode until the 8 blocks run out; then the newest (b) is preempted
    preempted = []
    for _ in range(20):
        for s in (a, b):
            if s in sched.running:
                s.token_ids.append(0)
        out = sched.schedule()
        for s in out.scheduled:
            s.seq.num_computed += s.num_tokens
        preempted += out.preempted
        if preempted:
            break
    assert preempted == [b] and b.num_computed == 0 and b.block_table == [] and sched.waiting[0] is b
    assert sched.num_preemptions == 1


def _admitted(sched: Scheduler) -> list[str]:
    return [s.seq.request_id for s in sched.schedule().scheduled]


def test_requests_arriving_between_two_steps_are_admitted_shortest_prompt_first():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, policy="shortest_first")
    for rid, n in (("a", 14), ("b", 6), ("c", 10), ("d", 6)):
        sched.add(seq(rid, list(range(n))))
    assert _admitted(sched) == ["b", "d", "c", "a"]  # ties (b, d) in arrival order


def test_shortest_first_never_puts_a_later_arrival_before_an_earlier_one():
    # one sequence slot: x runs, the rest wait across steps
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100, policy="shortest_first")
    x = seq("x", list(range(8)))
    sched.add(x)
    assert _admitted(sched) == ["x"]
    x.num_computed = 8
    x.token_ids.append(0)  # x decodes: one token a step
    sched.add(seq("long", list(range(30))))
    sched.add(seq("short", list(range(5))))
    assert _admitted(sched) == ["x"]
    x.num_computed += 1
    x.token_ids.append(0)
    assert [s.request_id for s in sched.waiting] == ["short", "long"]
    sched.add(seq("tiny", list(range(2))))  # arrived a step later: behind both, however short
    p = seq("p", list(range(3)))
    sched.add(p)
    sched.abort("p")  # a removed arrival leaves the count of arrivals right
    assert _admitted(sched) == ["x"]
    assert [s.request_id for s in sched.waiting] == ["short", "long", "tiny"]


def test_fcfs_admits_in_arrival_order():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    assert sched.policy == "fcfs"  # the default
    for rid, n in (("a", 14), ("b", 6), ("c", 10)):
        sched.add(seq(rid, list(range(n))))
    assert _admitted(sched) == ["a", "b", "c"]


def test_an_unknown_scheduling_policy_is_refused_by_name():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="'lifo'.*fcfs, shortest_first"):
        Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=8, policy="lifo")
    with pytest.raises(ConfigError, match="scheduling_policy='lifo' is invalid: one of 'fcfs', 'shortest_first'"):
        EngineConfig(scheduling_policy="lifo")
