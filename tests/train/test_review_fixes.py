"""Pipeline micro-batch counts refused before anything is built, and resume after a crash in the
middle of replacing a checkpoint of the same step."""

from __future__ import annotations

import os
import shutil

import pytest

from tessera.checkpoint import dcp as ckpt
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.parallel.dims import ParallelDims
from tessera.train.run_layout import check_batch_layout, schedule_accepts_microbatches
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink

PP2 = {"parallel.pp": 2, "parallel.dp_shard": 1}


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


def test_resume_after_crash_while_replacing_the_same_step(small_dataset, tmp_path):
    """A save of step N when step_N exists moves it to `.old-step_N-PID`, renames the new save from
    `.tmp-step_N-PID` into place and only then deletes the old one (dcp._complete). A crash between
    the two renames leaves both aside and `latest` naming the missing step_N: resume must put the
    old step_N back first and continue from it, not from an older checkpoint."""
    overrides = shrink(small_dataset, tmp_path, 2, **{"checkpoint.interval": 1, "checkpoint.keep_last": 3})
    Trainer(load_config(TINY_DENSE, overrides)).train()
    root = tmp_path / "checkpoints"
    final = root / ckpt.step_dir_name(2)
    pid = 4242
    old, new = root / f".old-{final.name}-{pid}", root / f".tmp-{final.name}-{pid}"
    shutil.copytree(final, new)  # the second save of step 2, complete with meta.json
    os.rename(final, old)  # ... and the crash came before `os.rename(tmp, final)`
    assert (root / ckpt.LATEST).read_text().strip() == final.name
    assert ckpt.find_latest(root) == root / ckpt.step_dir_name(1)  # what a resume decided before cleanup

    resumed = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path, 3, **{"checkpoint.interval": 1,
                                                                                    "checkpoint.keep_last": 3})),
                      resume=True)
    assert resumed.step == 2 and resumed.resumed_from == final
    assert ckpt.is_complete(final) and not old.exists() and not new.exists()
    result = resumed.train()
    assert result.start_step == 2 and [r["step"] for r in result.records] == [3]
