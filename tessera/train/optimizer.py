"""AdamW with configurable weight-decay groups.

A parameter decays iff it is a matrix (ndim >= 2: projections, experts, the LM head) and its
name matches none of `optim.no_decay` (fnmatch patterns, default `tok_embeddings.*`). Vectors
(RMSNorm gains, biases) do not decay unless `optim.decay_vectors` is set. Decay is decoupled
from the gradient (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization").

`build_optimizers` picks per layout: this AdamW per model part, or under
`parallel.optimizer=distributed` (several ranks) one `DistributedOptimizer` per part, which holds
fp32 master shards instead (tessera.parallel.distributed_optimizer).

The optimizer always holds the fp32 parameters: in bf16 mode the model keeps fp32 weights and
computes under autocast, so these are the master weights and Adam's moments are fp32 too.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from tessera.config.errors import ConfigError
from tessera.config.schema import OptimConfig, RunConfig
from tessera.parallel.dims import ParallelDims


def decays(name: str, param: torch.Tensor, cfg: OptimConfig) -> bool:
    """Whether parameter `name` gets weight decay under `cfg`."""
    if param.ndim < 2 and not cfg.decay_vectors:
        return False
    return not any(fnmatch.fnmatchcase(name, pattern) for pattern in cfg.no_decay)


def weight_decay_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two parameter groups, `decay` and `no_decay`, each with the names of its parameters.

    Tied parameters appear once (under their first name). Frozen parameters are left out.
    """
    groups = {True: {"names": [], "params": []}, False: {"names": [], "params": []}}
    for name, param in model.named_parameters():
        if param.requires_grad:
            g = groups[decays(name, param, cfg)]
            g["names"].append(name)
            g["params"].append(param)
    return [
        {"name": "decay", "weight_decay": cfg.weight_decay, **groups[True]},
        {"name": "no_decay", "weight_decay": 0.0, **groups[False]},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `weight_decay_groups(model, cfg)`; the schedule sets `lr` before each step. A part
    with nothing to train (a pipeline stage of a frozen language model) gets one empty group: an
    optimizer that steps nothing and holds no state (`has_parameters`)."""
    groups = [g for g in weight_decay_groups(model, cfg) if g["params"]]
    groups = groups or weight_decay_groups(model, cfg)[1:]  # torch refuses an optimizer with no group
    for g in groups:
        del g["names"]  # the optimizer's state_dict must stay plain data; names live in the model
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=True if cfg.fused else None)


def has_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` updates any parameter (`build_optimizer`: a frozen part's does not)."""
    return any(g["params"] for g in optimizer.param_groups)


def check_distributed_optimizer(cfg: RunConfig, dims: ParallelDims | None) -> None:
    """Refuse what `parallel.optimizer=distributed` is not wired into (every parallel layout is;
    train.compile=true is refused by tessera.parallel.compile.resolve_compile)."""
    if cfg.parallel.optimizer != "distributed" or dims is None:
        return  # one process: its AdamW holds everything, there is nothing to distribute
    if cfg.train.dtype == "fp16":
        raise ConfigError("parallel.optimizer=distributed with train.dtype=fp16 is not supported: loss scaling is "
                          "not wired into it; use train.dtype=bf16 or fp32")


def build_optimizers(parts: list[nn.Module], cfg: RunConfig, dims: ParallelDims | None,
                     param_dtype: torch.dtype) -> list:
    """One optimizer per model part: AdamW, or with `parallel.optimizer=distributed` on several
    ranks a DistributedOptimizer (weights replicated in `param_dtype`; under pp, one per stage part,
    reducing after the schedule)."""
    o = cfg.optim
    if cfg.parallel.optimizer != "distributed" or dims is None:
        return [build_optimizer(m, o) for m in parts]
    from tessera.parallel.distributed_optimizer import DistributedOptimizer

    return [DistributedOptimizer(m, dims, weight_decay_groups(m, o), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                 fused=bool(o.fused), bucket_mb=cfg.parallel.bucket_mb, param_dtype=param_dtype,
                                 overlap=dims.pp == 1, key_prefix=f"part{i}")
            for i, m in enumerate(parts)]
