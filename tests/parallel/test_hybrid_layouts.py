"""A hybrid model (Qwen3-Next: Gated DeltaNet layers beside gated attention, routed experts) under
data, expert and tensor (+ sequence) parallelism equals one process (fp32, 1e-5), with sequences of
several DeltaNet chunks, so that the chunked form's state passes from chunk to chunk inside each
rank; under tp each rank runs one of the two key-head groups, its conv channels and heads' gains."""

import dataclasses

import pytest

from tessera.config import get_preset
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import assert_same_step, layout_step, reference_step

SHORT_CHUNKS = {"linear_attention": dataclasses.replace(get_preset("tiny-qwen3-next").linear_attention, chunk_size=4)}


_refs: dict = {}


def _reference(micro: int) -> dict:
    if micro not in _refs:
        _refs[micro] = reference_step("tiny-qwen3-next", micro, SHORT_CHUNKS)
    return _refs[micro]


@pytest.mark.dist
@pytest.mark.parametrize("parallel,micro", [
    (dict(dp_shard=2), 2), (dict(dp_replicate=2, dp_shard=1), 2), (dict(ep=2, dp_shard=2), 2),
    (dict(tp=2, dp_shard=1), 1), (dict(tp=2, sp=True, dp_shard=1), 1)],
    ids=["fsdp2", "replicate2", "ep2-fsdp2", "tp2", "tp2-sp"])
def test_hybrid_layouts_match_one_process(parallel, micro):
    got = run_ranks(layout_step, 2, "tiny-qwen3-next", parallel, config_overrides=SHORT_CHUNKS)
    assert_same_step(got[0], _reference(micro))
