"""One training step (forward + backward + grad-norm + AdamW) and a second forward, run either in
one process (the reference) or on forked ranks under a parallel layout, following the numerics
contract: loss = sum of token losses / loss tokens of the global batch + aux / micro-batches."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.parallel import (
    ParallelDims,
    clip_grad_norm_,
    global_sum,
    parallelize,
    shard_global_batch,
)
from tessera.train.objectives.loss import token_loss_sum

SEED = 0
LR = 1e-2
MAX_NORM = 0.1  # small enough to clip: the clipped gradient must be the same everywhere


def tiny_config(preset: str, **overrides):
    return get_preset(preset, **overrides)


def global_batch(vocab: int, rows: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))


def _micro_batch_losses(model, micro, n_tokens: int, n_micro: int, backward: bool) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for mb in micro:
        out = model(mb[:, :-1])
        loss = token_loss_sum(out.logits, mb[:, 1:]) / n_tokens + out.aux_loss / n_micro
        if backward:
            loss.backward()
        total += loss.detach().double()
    return total


def full_tensors(named) -> dict[str, torch.Tensor]:
    """Every tensor gathered whole (a collective for DTensors: call on every rank, same order)."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in named}


def _step(model, micro, n_tokens, n_micro, dims):
    # eps well above the clipped gradients keeps Adam's first step linear in the gradient: with the
    # default eps the step is ~lr*sign(g), which turns rounding noise in gradients that are ~0
    # into lr-sized differences and would hide what the test is about.
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-3, weight_decay=0.1)
    loss1 = _micro_batch_losses(model, micro, n_tokens, n_micro, backward=True)
    grads = full_tensors((n, p.grad) for n, p in model.named_parameters() if p.requires_grad)  # not frozen ones
    norm = clip_grad_norm_(model.parameters(), MAX_NORM, dims)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        loss2 = _micro_batch_losses(model, micro, n_tokens, n_micro, backward=False)
    return loss1, loss2, norm, grads


def reference_step(preset: str, micro_batches: int, config_overrides: dict | None = None,
                   prepare: Callable[[Transformer], None] | None = None) -> dict:
    """Single process; the global batch cut into `micro_batches` equal micro-batches. `prepare` changes
    the model before it trains (what it trains: the indexer loss's switch)."""
    cfg = tiny_config(preset, **(config_overrides or {}))
    model = Transformer(cfg, init_seed=SEED)
    if prepare is not None:
        prepare(model)
    batch = global_batch(cfg.vocab_size)
    micro = batch.chunk(micro_batches)
    loss1, loss2, norm, grads = _step(model, micro, batch[:, 1:].numel(), micro_batches, None)
    weights = full_tensors(model.named_parameters())
    return {"loss1": loss1.item(), "loss2": loss2.item(), "norm": norm.item(), "weights": weights,
            "grads": grads}


def layout_step(preset: str, parallel: dict, micro_per_rank: int = 1, config_overrides: dict | None = None,
                prepare: Callable[[Transformer], None] | None = None) -> dict:
    """Runs on every forked rank: the same step under `ParallelConfig(**parallel)`, the model
    changed by `prepare` before it is parallelized."""
    world = torch.distributed.get_world_size()
    pcfg = ParallelConfig(**parallel)
    cfg = tiny_config(preset, **(config_overrides or {}))
    dims = ParallelDims.from_config(pcfg, world)
    batch = global_batch(cfg.vocab_size)
    dims.validate(cfg, world, seq_len=batch.shape[1] - 1)
    dims.build_mesh("cpu")
    model = Transformer(cfg, init_seed=SEED)
    if prepare is not None:
        prepare(model)
    model = parallelize(model, dims, pcfg)
    rows = shard_global_batch(batch, dims)
    loss1, loss2, norm, grads = _step(model, rows.chunk(micro_per_rank), batch[:, 1:].numel(),
                                      dims.dp_size * micro_per_rank, dims)
    weights = full_tensors(model.named_parameters())
    result = {"loss1": global_sum(loss1, dims).item(), "loss2": global_sum(loss2, dims).item(),
              "norm": norm.item()}
    if torch.distributed.get_rank() == 0:
        result.update(weights=weights, grads=grads)
    return result


def assert_same_step(got: dict, ref: dict, rtol: float = 1e-5) -> None:
    for key in ("loss1", "loss2", "norm"):
        assert abs(got[key] - ref[key]) <= rtol * abs(ref[key]), (key, got[key], ref[key])
    assert set(got["weights"]) == set(ref["weights"])
    for name, g in ref["grads"].items():
        err = (got["grads"][name] - g).norm() / g.norm().clamp_min(1e-30)
        assert err <= rtol, f"gradient of {name} differs by {err:.2e} (relative norm)"
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=rtol, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")

