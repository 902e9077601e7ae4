"""`parallel.microbatches` is refused where it would be ignored (pp = 1), in a count the schedule
cannot run (before anything is built, and when a pipeline is built directly), and for an MoE model
in any count other than the one-process micro-batches; the schedules' micro-batch rule."""

from __future__ import annotations

import pytest

from tessera.config.errors import ConfigError
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.parallel.dims import ParallelDims
from tessera.parallel.pipeline import build_pipeline
from tessera.train.run_layout import check_batch_layout, schedule_accepts_microbatches
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
    # An MoE model cannot change its micro-batch, so it is told which micro_batch_size fits.
    with pytest.raises(ConfigError, match=r"allows train.micro_batch_size in \[5, 1\]"):
        _check(TINY_MOE, tmp_path, **layout)


def test_schedule_rule():
    accepted = [m for m in range(1, 17) if schedule_accepts_microbatches("interleaved_1f1b", m, 4)]
    assert accepted == [4, 5, 6, 7, 8, 10, 12, 15, 16]
    assert [m for m in range(1, 6) if schedule_accepts_microbatches("1f1b", m, 2)] == [2, 3, 4, 5]
    assert all(schedule_accepts_microbatches("gpipe", m, 4) for m in range(1, 9))


def test_moe_refuses_microbatches_other_than_the_micro_batch_size(tmp_path):
    # 8 rows per rank of micro-batches of 2: the one-process run has 4 micro-batches of 2 samples.
    layout = {**PP2, "parallel.pp_schedule": "1f1b", "train.global_batch_size": 8, "train.micro_batch_size": 2}
    with pytest.raises(ConfigError, match=r"parallel.microbatches=2 is invalid for an MoE model: it cuts the 8 "
                                          r"samples of each data-parallel rank into micro-batches of 4, not "
                                          r"train.micro_batch_size=2.*auxiliary losses and expert capacity"
                                          r".*set it to 4"):
        _check(TINY_MOE, tmp_path, **{**layout, "parallel.microbatches": 2})
    _check(TINY_MOE, tmp_path, **{**layout, "parallel.microbatches": 4})  # the same micro-batches: fine
    _check(TINY_MOE, tmp_path, **layout)
    _check(TINY_DENSE, tmp_path, **{**layout, "parallel.microbatches": 2})  # dense: only memory changes
