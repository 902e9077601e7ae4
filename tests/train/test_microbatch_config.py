"""`parallel.microbatches` is refused where it would be ignored (pp = 1) and, when a pipeline is
built directly, in a count the schedule cannot run."""

from __future__ import annotations

import pytest

from tessera.config.errors import ConfigError
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.parallel.dims import ParallelDims
from tessera.parallel.pipeline import build_pipeline
from tessera.train.run_layout import check_batch_layout
from tests.train.runs import TINY_DENSE, shrink


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
