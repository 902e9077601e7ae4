"""A hybrid model (Qwen3-Next: Gated DeltaNet layers beside gated attention, routed experts) under
data and expert parallelism equals one process (fp32, 1e-5), with sequences of several DeltaNet
chunks, so that the chunked form's state passes from chunk to chunk inside each rank."""

import dataclasses

import pytest

from tessera.config import get_preset
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import assert_same_step, layout_step, reference_step

SHORT_CHUNKS = {"linear_attention": dataclasses.replace(get_preset("tiny-qwen3-next").linear_attention, chunk_size=4)}


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [dict(dp_shard=2), dict(dp_replicate=2, dp_shard=1), dict(ep=2, dp_shard=2)],
                         ids=["fsdp2", "replicate2", "ep2-fsdp2"])
def test_hybrid_layouts_match_one_process(parallel):
    got = run_ranks(layout_step, 2, "tiny-qwen3-next", parallel, config_overrides=SHORT_CHUNKS)
    assert_same_step(got[0], reference_step("tiny-qwen3-next", 2, SHORT_CHUNKS))
