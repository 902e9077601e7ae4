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
        self.cast: set[int] = set()  # the storages cast

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            src = args[0]
            if src.dtype == torch.float32 and src.data_ptr() in self.ptrs:
                self.count += 1
                self.cast.add(src.data_ptr())
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


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-gpt-oss", "tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear",
                                  "tiny-nemotron-h", "tiny-nemotron-h-moe"])
def test_every_weight_autocast_casts_is_cached_with_autocasts_arithmetic(name):
    """Every parameter autocast casts in a forward is among the cached ones (the recurrent layers' short
    convolutions and relu^2 experts included: left out, autocast would cast them again in every
    micro-batch), and the forward with the cached copies gives autocast's logits and fp32 gradients to
    the bit (Kimi's three convolutions are concatenated before the cast: cached, the same values)."""
    from tessera.config.presets import get_preset
    from tessera.models.transformer import Transformer
    from tessera.train.steps.compute_weights import CachedComputeWeights

    torch.manual_seed(0)
    cfg = get_preset(name)
    model = Transformer(cfg)
    params = dict(model.named_parameters())
    names = cast_weight_names(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    cached = CachedComputeWeights(model, torch.bfloat16)
    out, grads = {}, {}
    for mode in ("autocast", "cached"):
        model.zero_grad(set_to_none=True)
        with ParameterCasts(params.values()) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(tokens) if mode == "autocast" else cached.forward(tokens)
            logits = output.logits
        if mode == "autocast":
            casts = counter.cast
        (logits.float().square().mean() + output.aux_loss).backward()
        out[mode] = logits.detach()
        grads[mode] = {n: p.grad for n, p in params.items() if p.grad is not None}
    by_ptr = {p.data_ptr(): n for n, p in params.items()}
    assert {by_ptr[p] for p in casts} <= set(names)
    assert torch.equal(out["cached"], out["autocast"])
    assert grads["cached"].keys() == grads["autocast"].keys()
    for n, g in grads["cached"].items():
        assert torch.equal(g, grads["autocast"][n]), n
