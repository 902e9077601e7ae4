"""`parallel.microbatches` is refused where it would be ignored (pp = 1) and in a count the
schedule cannot run (before anything is built, and when a pipeline is built directly), and accepted
in any other count, for dense and MoE models alike; the schedules' micro-batch rule."""

from __future__ import annotations

import pytest

from tessera.config.errors import ConfigError
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.parallel.dims import ParallelDims
from tessera.parallel.pipeline import build_pipeline
from tessera.train.run.layout import check_batch_layout, schedule_accepts_microbatches
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink

PP2 = {"parallel.pp": 2, "parallel.dp_shard": 1}


def test_microbatches_without_pipeline_is_refused(tmp_path):
    cfg = load_config(TINY_DENSE, shrink("unused", tmp_path, 1, **{"parallel.dp_shard": 2,
                                                                     "parallel.microbatches": 2}))
    with pytest.raises(ConfigError, match=r"parallel.microbatches=2 is invalid: parallel.microbatches only applies "
                                          r"with parallel.pp > 1.*global_batch_size / \(micro_batch_size x "
                                          r"data-parallel size\) = 4 / \(2 x 2\)"):
        check_batch_layout(cfg, ParallelDims.from_config(cfg.parallel, 2))
    cfg.parallel.microbatches = None
    check_batch_layout(cfg, ParallelDims.from_config(cfg.parallel, 2))


@pytest.mark.parametrize("schedule,vpp,microbatches", [("1f1b", 1, 1), ("interleaved_1f1b", 2, 5)])
def test_build_pipeline_refuses_a_count_the_schedule_cannot_run(schedule, vpp, microbatches, tmp_path):
    cfg = load_config(TINY_DENSE, shrink("unused", tmp_path, 1, **{"model.n_layers": 4}))
    pcfg = ParallelConfig(pp=2, dp_shard=1, vpp=vpp, pp_schedule=schedule)
    dims = ParallelDims.from_config(pcfg, 2)
    with pytest.raises(ConfigError, match=rf"parallel.microbatches={microbatches} is invalid for "
                                          rf"parallel.pp_schedule={schedule} with parallel.pp=2"):
        build_pipeline(Transformer(cfg.model, init_seed=None), dims, pcfg, microbatches,
                       loss_fn=lambda logits, targets: logits.sum(), aux_scale=1.0)


def _check(config: str, tmp_path, **overrides) -> None:
    shrink_fn = moe_shrink if config == TINY_MOE else shrink
    cfg = load_config(config, shrink_fn("unused", tmp_path, 1, **overrides))
    check_batch_layout(cfg, ParallelDims.from_config(cfg.parallel, 2))


@pytest.mark.parametrize("schedule,vpp", [("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_round_schedules_refuse_a_count_torch_rejects(schedule, vpp, tmp_path):
    # 10 rows in micro-batches of 2: m = 5 micro-batches, m // pp = 2 rounds, 5 % 2 != 0.
    layout = {**PP2, "parallel.pp_schedule": schedule, "parallel.vpp": vpp, "model.n_layers": 4,
              "train.global_batch_size": 10, "train.micro_batch_size": 2}
    with pytest.raises(ConfigError, match=r"5 micro-batches per data-parallel rank \(parallel.microbatches unset: "
                                          r"train.global_batch_size / dp / train.micro_batch_size = 10 / 1 / 2\)"
                                          r".*2 rounds.*allows parallel.microbatches in \[2, 10\]"):
        _check(TINY_DENSE, tmp_path, **layout)
    with pytest.raises(ConfigError, match=r"\(parallel.microbatches=5\) are invalid"):
        _check(TINY_DENSE, tmp_path, **{**layout, "train.micro_batch_size": 1, "parallel.microbatches": 5})
    _check(TINY_DENSE, tmp_path, **{**layout, "parallel.microbatches": 2})  # what the message offers
    _check(TINY_DENSE, tmp_path, **{**layout, "train.global_batch_size": 12})  # 6 = 3 rounds of 2
    _check(TINY_DENSE, tmp_path, **{**layout, "parallel.pp_schedule": "1f1b", "parallel.vpp": 1})  # no rounds
    # An MoE model is offered the same counts (its aux losses follow the pipeline's micro-batch).
    with pytest.raises(ConfigError, match=r"allows parallel.microbatches in \[2, 10\]"):
        _check(TINY_MOE, tmp_path, **layout)
    _check(TINY_MOE, tmp_path, **{**layout, "parallel.microbatches": 2})


def test_schedule_rule():
    accepted = [m for m in range(1, 17) if schedule_accepts_microbatches("interleaved_1f1b", m, 4)]
    assert accepted == [4, 5, 6, 7, 8, 10, 12, 15, 16]
    assert [m for m in range(1, 6) if schedule_accepts_microbatches("1f1b", m, 2)] == [2, 3, 4, 5]
    assert all(schedule_accepts_microbatches("gpipe", m, 4) for m in range(1, 9))


def test_moe_takes_any_microbatch_count(tmp_path):
    # 8 rows per rank in micro-batches of 2 by train.micro_batch_size; the pipeline may cut them
    # into 2 micro-batches of 4 instead: the MoE aux losses and capacity are those micro-batches'.
    layout = {**PP2, "parallel.pp_schedule": "1f1b", "train.global_batch_size": 8, "train.micro_batch_size": 2}
    for m in (2, 4, 8):
        _check(TINY_MOE, tmp_path, **{**layout, "parallel.microbatches": m})
    with pytest.raises(ConfigError, match=r"parallel.microbatches=3 is invalid: it must divide the 8 samples"):
        _check(TINY_MOE, tmp_path, **{**layout, "parallel.microbatches": 3})
