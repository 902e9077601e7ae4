"""The two ways a profiled step's collectives are timed (tessera/train/run/profile_record.py) find the
same collectives under data and pipeline parallelism: the process groups' wrapped methods (what
those layouts use, a cost per collective) and the dispatch mode that sees every operator (what tensor,
context and expert parallelism need). Real gloo ranks, the same steps recorded by each in turn; after
a recorded step the process group's methods are the originals again."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch.distributed as dist

from tessera.config.schema import load_config
from tessera.train.run import profile_record
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import TINY_DENSE
from tests.train.runs import shrink

pytestmark = [pytest.mark.dist]


def _collectives_by_each_timer(overrides: list[str]) -> dict:
    """(kind, group) -> count of the comm intervals of step 2 and of step 3, the first recorded by the
    process-group timer, the second by the dispatch mode; and whether the methods were put back."""
    trainer = Trainer(load_config(TINY_DENSE, overrides), profile=(2, 3))
    recorder = trainer.recorder
    assert recorder is not None and not recorder.functional  # dp / pp only: the cheap timer by default
    originals = dict(vars(dist.ProcessGroup))
    trainer.train_step()  # step 1: outside the window, warms up
    found = {}
    for step, functional in ((2, False), (3, True)):
        recorder.functional = functional
        with recorder.step_block(trainer.step + 1):
            trainer.train_step()
        lines = [json.loads(text) for text in recorder.path.read_text().splitlines()]
        lines = [line for line in lines if line.get("step") == step]
        found[functional] = Counter((line["name"], line["group"]) for line in lines if line["kind"] == "comm")
    restored = all(vars(dist.ProcessGroup)[name] is originals[name] for name in profile_record._PG_METHODS
                   if name in originals)
    return {"wrapped": found[False], "dispatch": found[True], "restored": restored}


@pytest.mark.parametrize("layout", [{"parallel.dp_shard": 2}, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}],
                         ids=["fsdp2", "pipeline"])
def test_the_wrapped_process_groups_find_the_collectives_the_dispatch_mode_finds(small_dataset, tmp_path, layout):
    overrides = shrink(small_dataset, tmp_path / "run", 3, **layout, **{"checkpoint.interval": 0})
    for rank in run_ranks(_collectives_by_each_timer, 2, overrides, timeout=120):
        assert rank["restored"]
        assert rank["wrapped"] and rank["wrapped"] == rank["dispatch"], rank
