"""On several ranks the Trainer builds the model on the meta device, parallelizes it and initialises
only its own shards by name: the whole model gathered from the ranks equals, exactly, the one-process
`Transformer(cfg, init_seed=seed)` under every layout kind (TP, FSDP, EP x FSDP, pipeline stages)."""

from __future__ import annotations

import pytest
import torch

from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.parallel.meta_init import materialize_by_name
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import MODELS, overrides_for, whole_parameters


def _initial_state_on_ranks(model: str, overrides: list[str]) -> dict:
    trainer = Trainer(load_config(MODELS[model][0], overrides))
    assert not any(p.is_meta for m in trainer.parts for p in m.parameters())
    state = whole_parameters(trainer.parts)
    for m in trainer.parts:
        state.update({name: b.detach().clone() for name, b in m.named_buffers()})
    return state


def _one_process_state(model: str, overrides: list[str]) -> dict[str, torch.Tensor]:
    cfg = load_config(MODELS[model][0], overrides)
    reference = Transformer(cfg.model, init_seed=cfg.train.seed)
    return {**dict(reference.named_parameters()), **dict(reference.named_buffers())}


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", [
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="dense-tp2"),
    pytest.param("dense", 2, {"parallel.dp_shard": 2}, id="dense-fsdp2"),
    pytest.param("moe", 2, {"parallel.ep": 2, "parallel.dp_shard": 2}, id="moe-ep2-fsdp2"),
    pytest.param("moe", 2, {"parallel.pp": 2, "parallel.dp_shard": 1}, id="moe-pp2"),
    pytest.param("dense", 4, {"parallel.tp": 2, "parallel.dp_shard": 2}, id="dense-tp2-fsdp2"),
])
def test_meta_initialisation_equals_the_one_process_model(model, world, parallel, small_dataset, tmp_path):
    overrides = overrides_for(model, small_dataset, tmp_path, 1, **parallel)
    want = _one_process_state(model, overrides)
    results = run_ranks(_initial_state_on_ranks, world, model, overrides)
    got: dict[str, torch.Tensor] = {}
    for r in results:
        got.update(r)
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_materialize_by_name_on_one_process_equals_init_weights(small_dataset, tmp_path):
    cfg = load_config(MODELS["moe"][0], overrides_for("moe", small_dataset, tmp_path, 1))
    with torch.device("meta"):
        model = Transformer(cfg.model, init_seed=None)
        reference = Transformer(cfg.model, init_seed=None)
    materialize_by_name([model], reference, 7, "cpu")
    want = Transformer(cfg.model, init_seed=7)
    for (name, got), (_, value) in zip(model.state_dict(keep_vars=True).items(), want.state_dict().items()):
        assert torch.equal(got.detach(), value), name
    assert torch.equal(model.rope_inv_freq, want.rope_inv_freq)
