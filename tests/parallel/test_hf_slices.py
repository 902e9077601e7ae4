"""`local_box` of a parallelized parameter is the box of the whole tensor its shard holds, and
`HFSliceReader` reads exactly that box from a HuggingFace directory: under tensor, expert x data and
nested tensor x data parallelism the box read from the files equals the rank's local shard."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tessera.checkpoint.hf.slices import HFSliceReader, local_box
from tessera.config.schema import load_config
from tessera.hf import save_pretrained
from tessera.models import Transformer
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import MODELS, overrides_for


def _boxes_equal_shards(model: str, overrides: list[str], hf_dir: str) -> tuple[int, int]:
    trainer = Trainer(load_config(MODELS[model][0], overrides))
    reader = HFSliceReader(hf_dir, trainer.cfg.model)
    sharded = 0
    for part in trainer.parts:
        for name, p in part.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            offsets, sizes = local_box(p)
            assert tuple(local.shape) == sizes, name
            got = reader.read(name, offsets, sizes)
            assert torch.equal(got, local.detach()), name
            sharded += isinstance(p, DTensor) and local.numel() < p.numel()
    return reader.bytes_read, sharded


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", [
    pytest.param("dense", 4, {"parallel.tp": 2, "parallel.dp_shard": 2}, id="dense-tp2-fsdp2"),
    pytest.param("moe", 4, {"parallel.ep": 2, "parallel.dp_shard": 4, "train.micro_batch_size": 1}, id="moe-ep2-fsdp4"),
    pytest.param("moe", 4, {"parallel.tp": 2, "parallel.ep": 2, "parallel.dp_shard": 2}, id="moe-tp2-ep2"),
])
def test_the_box_read_from_the_files_is_the_local_shard(model, world, parallel, small_dataset, tmp_path):
    overrides = overrides_for(model, small_dataset, tmp_path / "run", 1, **parallel)
    cfg = load_config(MODELS[model][0], overrides)
    whole = Transformer(cfg.model, init_seed=cfg.train.seed)  # what every rank initialises by name
    save_pretrained(whole, tmp_path / "hf")
    total = sum(t.numel() * t.element_size() for t in whole.state_dict().values() if t.is_floating_point())
    results = run_ranks(_boxes_equal_shards, world, model, overrides, str(tmp_path / "hf"))
    for read, sharded in results:
        assert sharded > 0
        assert read < total / 2  # each rank read well under the whole model
