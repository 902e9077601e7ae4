"""The engine's sleep and wake (LLMEngine.sleep / wake; GRPO's rollout phases use them): asleep, its
paged KV cache holds no memory (the cache's own byte count and each store's storage), its prefix
cache is empty and it refuses to step; woken, the cache is allocated again at its size and the
same seeded requests decode the same tokens and log-probabilities as before it slept. What it
cannot release is refused in one line."""

from __future__ import annotations

import pytest

from tessera.config.errors import ConfigError
from tessera.infer.config import EngineConfig
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.sampling.params import SamplingParams
from tests.infer.tiny_models import write_model

PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6], [5, 9, 2, 7, 1, 3, 8, 4, 11], [12, 3]]


def _decode(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, logprobs=0))
           for i, p in enumerate(PROMPTS)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [(list(done[i].token_ids), [lp.logprob for lp in done[i].logprobs]) for i in ids]


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8-kv"])
def test_asleep_the_kv_cache_holds_no_memory_and_woken_it_decodes_the_same(tmp_path, int8):
    write_model(tmp_path, "llama")
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, max_num_seqs=4, cpu_prepack=False,
                                                       kv_cache_dtype="int8" if int8 else None))
    awake = engine.kv.nbytes
    assert awake > 0 and not engine.sleeping
    first = _decode(engine)
    assert len(engine.blocks.cache) > 0  # the prompts' shared prefix is cached
    engine.sleep()
    assert engine.sleeping and engine.kv.nbytes == 0
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.kv.stores())
    assert len(engine.blocks.cache) == 0 and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match=r"the engine sleeps \(its KV cache is released\): call wake\(\)"):
        engine.step()
    engine.abort(next(iter(engine.scheduler.waiting)).request_id)
    engine.wake()
    assert not engine.sleeping and engine.kv.nbytes == awake
    assert _decode(engine) == first


def test_an_engine_with_an_unfinished_request_does_not_sleep(tmp_path):
    write_model(tmp_path, "llama")
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, cpu_prepack=False))
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    engine.step()
    with pytest.raises(ConfigError, match=r"sleep\(\) needs an idle engine: no unfinished request"):
        engine.sleep()
    assert engine.kv.nbytes > 0
