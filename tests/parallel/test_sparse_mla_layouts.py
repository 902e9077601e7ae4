"""DeepSeek-V3.2's sparse attention (tiny-deepseek-v32: index_topk 8 over 16 tokens, so each query past
the eighth attends to half its keys or fewer) trains under fsdp, tp (the indexer replicated beside the
latent projections, every rank choosing the same keys for its heads), tp + sp and ep x fsdp with one
process's losses, gradients and updated weights (fp32, 1e-5); so does a step with the indexer's KL loss
(train.indexer_loss: its sparse stage, and the dense warm-up with all else frozen), whose target sums the
heads of every tp rank; cp is refused by name, since the indexer scores keys of the whole sequence."""

from functools import partial

import pytest

from tessera.config import get_preset
from tessera.config.layout_rules import LayoutSizes, layout_problems
from tessera.train.indexer_loss import train_indexers
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import assert_same_step, layout_step, reference_step

PRESET = "tiny-deepseek-v32"
_refs: dict = {}


def _reference(micro: int) -> dict:
    if micro not in _refs:
        _refs[micro] = reference_step(PRESET, micro)
    return _refs[micro]


@pytest.mark.dist
@pytest.mark.parametrize("parallel,world,micro", [
    pytest.param(dict(dp_shard=2), 2, 2, id="fsdp2"),
    pytest.param(dict(tp=2, dp_shard=1), 2, 1, id="tp2"),
    pytest.param(dict(tp=2, sp=True, dp_shard=1), 2, 1, id="tp2-sp"),
    pytest.param(dict(ep=2, dp_shard=2), 2, 2, id="ep2-fsdp2"),
])
def test_sparse_attention_layouts_match_one_process(parallel, world, micro):
    got = run_ranks(layout_step, world, PRESET, parallel)
    assert_same_step(got[0], _reference(micro))
    assert "layers.1.attention.wkv_a.weight" in got[0]["grads"]


INDEXER_LOSS = {"sparse": partial(train_indexers, weight=1.0, stage="sparse"),
                "dense": partial(train_indexers, weight=1.0, stage="dense")}


@pytest.mark.dist
@pytest.mark.parametrize("parallel,world,micro,stage", [
    pytest.param(dict(dp_shard=2), 2, 2, "sparse", id="fsdp2-sparse"),
    pytest.param(dict(tp=2, dp_shard=1), 2, 1, "sparse", id="tp2-sparse"),
    pytest.param(dict(tp=2, sp=True, dp_shard=1), 2, 1, "dense", id="tp2-sp-dense"),
    pytest.param(dict(ep=2, dp_shard=2), 2, 2, "sparse", id="ep2-fsdp2-sparse"),
])
def test_the_indexer_loss_under_layouts_matches_one_process(parallel, world, micro, stage):
    over = {"init_std": 0.1}  # attention far enough from uniform that the KL and its gradient are not ~0
    ref = reference_step(PRESET, micro, over, INDEXER_LOSS[stage])
    got = run_ranks(layout_step, world, PRESET, parallel, config_overrides=over, prepare=INDEXER_LOSS[stage])
    assert_same_step(got[0], ref)
    trained = {n for n in ref["grads"] if ".indexer." in n}
    assert trained and (stage == "sparse" or trained == set(ref["grads"]))
    assert all(ref["grads"][n].norm() > 0 for n in trained)


def test_context_parallelism_is_refused_by_name():
    problems = layout_problems(get_preset(PRESET), LayoutSizes(cp=2, dp_shard=1), seq_len=16)
    assert any("cp=2 cannot run sparse attention (model.mla.index_topk=8" in p for p in problems)
