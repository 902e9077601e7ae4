"""The wrapped entry points that time a profiled step's collectives (tessera/train/run/profile_record.py:
the process groups' methods and the functional collectives' operators, a cost per collective) find
the same collectives, by kind and group, as the dispatch mode that sees every operator (the
reference), under data, pipeline, tensor, context and expert parallelism. Real gloo ranks, the same
steps recorded by each in turn; after a recorded step the process groups' methods and the
`torch.ops._c10d_functional` operators are the originals again."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from tessera.config.schema import load_config
from tessera.parallel.comm_stats import FUNCTIONAL_KINDS
from tessera.train.run import profile_record
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink

pytestmark = [pytest.mark.dist]


def _entry_points() -> dict[str, object]:
    """Every entry point the timers wrap, by name, as it is now."""
    out = {f"pg.{name}": vars(dist.ProcessGroup)[name] for name in profile_record._PG_METHODS
           if name in vars(dist.ProcessGroup)}
    for namespace in profile_record.FunctionalCollectiveTimer.NAMESPACES:
        ops = getattr(torch.ops, namespace)
        out.update({f"{namespace}.{name}": getattr(ops, name) for name in FUNCTIONAL_KINDS if hasattr(ops, name)})
    return out


def _collectives_by_each_timer(config: str, overrides: list[str]) -> dict:
    """(kind, group) -> count of the comm intervals of step 2 and of step 3, the first recorded by the
    wrapped entry points, the second by the dispatch mode; and whether the entry points were put back."""
    trainer = Trainer(load_config(config, overrides), profile=(2, 3))
    recorder = trainer.recorder
    assert recorder is not None and not recorder.dispatch_mode  # the wrapped entry points by default
    originals = _entry_points()
    trainer.train_step()  # step 1: outside the window, warms up
    found = {}
    for step, dispatch_mode in ((2, False), (3, True)):
        recorder.dispatch_mode = dispatch_mode
        with recorder.step_block(trainer.step + 1):
            if not dispatch_mode:
                wrapped = sum(now is not originals[name] for name, now in _entry_points().items())
            trainer.train_step()
        lines = [json.loads(text) for text in recorder.path.read_text().splitlines()]
        lines = [line for line in lines if line.get("step") == step]
        found[dispatch_mode] = Counter((line["name"], line["group"]) for line in lines if line["kind"] == "comm")
    restored = all(now is originals[name] for name, now in _entry_points().items())
    return {"wrapped": found[False], "dispatch": found[True], "restored": restored, "n_wrapped": wrapped}


LAYOUTS = [
    pytest.param(TINY_DENSE, {"parallel.dp_shard": 2}, "dp", id="fsdp2"),
    pytest.param(TINY_DENSE, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}, "pp", id="pipeline"),
    pytest.param(TINY_DENSE, {"parallel.tp": 2}, "tp", id="tp"),
    pytest.param(TINY_DENSE, {"parallel.cp": 2}, "cp", id="cp"),
    pytest.param(TINY_MOE, {"parallel.ep": 2, "parallel.dp_shard": 2}, "ep", id="ep"),
]


@pytest.mark.parametrize("config, layout, group", LAYOUTS)
def test_the_wrapped_entry_points_find_the_collectives_the_dispatch_mode_finds(small_dataset, tmp_path, config,
                                                                                layout, group):
    shrink_fn = moe_shrink if config == TINY_MOE else shrink
    overrides = shrink_fn(small_dataset, tmp_path / "run", 3, **layout, **{"checkpoint.interval": 0})
    for rank in run_ranks(_collectives_by_each_timer, 2, config, overrides, timeout=180):
        assert rank["restored"] and rank["n_wrapped"] > 0, rank
        assert rank["wrapped"] and rank["wrapped"] == rank["dispatch"], rank
        assert any(g == group for _, g in rank["wrapped"]), rank  # the layout's own group is found by name
