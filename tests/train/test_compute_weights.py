"""bf16 compute copies of the weights made once per optimizer step (tessera.train.steps.compute_weights):
the same arithmetic as autocast (losses over 5 steps, gradients of one step), with each weight
cast once per step instead of once per micro-batch; fp32 runs do not use them."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config.schema import load_config
from tessera.train.steps.compute_weights import cast_weight_names
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink

CONFIGS = {"dense": (TINY_DENSE, shrink), "moe": (TINY_MOE, moe_shrink)}


class ParameterCasts(TorchDispatchMode):
    """Counts fp32 -> bf16 copies of the given tensors' storage."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            src = args[0]
            if src.dtype == torch.float32 and src.data_ptr() in self.ptrs:
                self.count += 1
        return func(*args, **kwargs)


def _trainer(dataset, tmp_path, config, cast: bool, dtype="bf16", steps=5) -> Trainer:
    path, shrink_fn = CONFIGS[config]
    return Trainer(load_config(path, shrink_fn(dataset, tmp_path / f"{cast}", steps, **{
        "train.dtype": dtype, "checkpoint.interval": 0, "train.cast_weights_per_step": cast})))


@pytest.mark.parametrize("config", CONFIGS)
def test_cached_compute_weights_train_like_autocast(small_dataset, tmp_path, config):
    losses = {cast: [r["loss"] for r in _trainer(small_dataset, tmp_path, config, cast).train().records]
              for cast in (False, True)}
    assert len(losses[True]) == 5
    for got, want in zip(losses[True], losses[False], strict=True):
        assert abs(got - want) <= 5e-3 * want, losses


@pytest.mark.parametrize("config", CONFIGS)
def test_each_weight_is_cast_once_per_step_and_gradients_are_autocasts(small_dataset, tmp_path, config):
    """Two micro-batches per step: autocast casts every matrix weight twice, the cache once;
    the fp32 gradients are the same numbers."""
    grads, casts = {}, {}
    for cast in (False, True):
        trainer = _trainer(small_dataset, tmp_path, config, cast, steps=1)
        assert trainer.accumulation == 2
        model = trainer.model
        names = cast_weight_names(model)
        assert "layers.0.attention.wq.weight" in names and "output.weight" in names
        assert not any("router" in n or "norm" in n or "tok_embeddings" in n for n in names)
        params = dict(model.named_parameters())
        batch = trainer.data.train.next_batch()
        with ParameterCasts([params[n] for n in names]) as counter:
            trainer.engine.forward_backward(batch)
        casts[cast] = (counter.count, len(names))
        grads[cast] = {n: p.grad for n, p in params.items() if p.grad is not None}
        assert all(g.dtype == torch.float32 for g in grads[cast].values())
    assert casts[True] == (casts[True][1], casts[True][1])  # once per step
    assert casts[False] == (2 * casts[False][1], casts[False][1])  # once per micro-batch
    assert grads[True].keys() == grads[False].keys()
    for n, g in grads[True].items():
        assert torch.equal(g, grads[False][n]), n


def test_fp32_runs_use_no_compute_copies(small_dataset, tmp_path):
    trainer = _trainer(small_dataset, tmp_path, "dense", True, dtype="fp32", steps=1)
    assert trainer.engine.compute_weights is None
