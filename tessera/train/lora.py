"""`train.lora` in the builder (tessera.train.builder): the model's base frozen, held quantized with
`quantize_base`, and low-rank adapters added on the layers the config targets (tessera.config.lora,
tessera.models.lora), before the model is parallelized.

In one process the adapters are added after `train.init_from` has filled the base (the base as read is
what `quantize_base` rounds), and initialised by name from `train.seed`. On ranks they are added to the
meta model and its meta `reference` alike, so that parallelization cuts them with their layers and
initialisation by name (tessera.parallel.meta_init) gives them the values one process has; with
`train.init_from` the source fills the base and `init_adapters` the adapters. A quantized base is one
process's only (refused on ranks, by name, before anything is allocated).
"""

from __future__ import annotations

from torch import nn

from tessera.config.errors import ParallelError
from tessera.config.lora import SAVED_MODULES, lora_targets
from tessera.config.schema import RunConfig
from tessera.models.lora import add_adapters
from tessera.models.quantized import quantize_model


def apply_lora(model: nn.Module, reference: nn.Module | None, cfg: RunConfig, on_ranks: bool) -> None:
    """Freeze `model` (and its meta `reference`), quantize its base with `quantize_base`, add the
    adapters; a no-op without train.lora. In one process the adapters are initialised from train.seed."""
    lora = cfg.train.lora
    if not lora.enabled:
        return
    if lora.quantize_base is not None and on_ranks:
        raise ParallelError(f"train.lora.quantize_base={lora.quantize_base!r} trains in one process only: the "
                            "quantized base is no layer FSDP, tensor or pipeline parallelism can cut; run without "
                            "--nproc / torchrun, or with train.lora.quantize_base=null")
    targets = list(lora_targets(cfg.model, lora))
    whole = [SAVED_MODULES[name] for name in lora.modules_to_save]
    if lora.quantize_base is not None:
        quantize_model(model, lora.quantize_base)
    add_adapters(model, targets, lora.rank, lora.scaling, lora.dropout, whole,
                 seed=None if on_ranks else cfg.train.seed)
    if reference is not None:
        add_adapters(reference, targets, lora.rank, lora.scaling, lora.dropout, whole)
