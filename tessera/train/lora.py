"""`train.lora` in the builder (tessera.train.builder): the model's base frozen, held quantized with
`quantize_base`, and low-rank adapters added on the layers the config targets (tessera.config.adapters.lora,
tessera.models.lora), before the model is parallelized.

In one process the adapters are added after `train.init_from` has filled the base, and initialised by
name from `train.seed`. On ranks they are added to the meta model and its meta `reference` alike, so
that parallelization cuts them with their layers and initialisation by name (tessera.parallel.meta_init)
gives them the values one process has; with `train.init_from` the source fills the base and
`init_adapters` the adapters.

A quantized base (QLoRA) is one process's only (refused on ranks, by name, before anything is
allocated), and never held in full precision: the model is built on the meta device, its block linear
layers quantized there (empty codes), and `load_quantized_base` reads each weight from its source (the
HuggingFace directory or Tessera checkpoint of `train.init_from`, else its initial value from
`train.seed`: a resumed run's checkpoint then replaces them), rounds it into its layer's codes and drops
it before the next, so the run's start holds the quantized model and one full-precision tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.hf.load import check_hf_fits
from tessera.checkpoint.hf.slices import HFSliceReader
from tessera.config.adapters.lora import SAVED_MODULES, lora_targets
from tessera.config.errors import ParallelError
from tessera.config.hf_config import is_hf_directory
from tessera.config.schema import RunConfig
from tessera.models.int8 import quantize_per_channel
from tessera.models.lora import add_adapters
from tessera.models.quantized import quantize_model
from tessera.models.transformer import Transformer

MODEL_PREFIX = "model."  # training checkpoints keep the weights under "model"


def holds_quantized_base(cfg: RunConfig, on_ranks: bool) -> bool:
    """Whether the run's base is QLoRA's (built on the meta device and filled by `load_quantized_base`)."""
    return cfg.train.lora.enabled and cfg.train.lora.quantize_base is not None and not on_ranks


def apply_lora(model: nn.Module, reference: nn.Module | None, cfg: RunConfig, on_ranks: bool) -> None:
    """Freeze `model` (and its meta `reference`), quantize its base with `quantize_base` (a no-op on a
    base `load_quantized_base` filled), add the adapters; a no-op without train.lora. In one process the
    adapters are initialised from train.seed."""
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


@torch.no_grad()
def load_quantized_base(model: Transformer, cfg: RunConfig, init_from: str | None, device: torch.device) -> int:
    """Quantize meta `model`'s base (train.lora.quantize_base), allocate it on `device` and fill it
    tensor by tensor from `init_from` or the seed, each block weight rounded as it is read (module
    docstring); returns the bytes read from `init_from`."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    quantize_model(model, cfg.train.lora.quantize_base)
    model.to_empty(device=device)
    model.reset_rope(device)
    value, bytes_read = _source(cfg, init_from, shapes)
    for name, module in model.named_modules():
        for leaf, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = f"{name}.{leaf}" if name else leaf
            if key in shapes:
                t.copy_(value(key))
            elif key.endswith("expert_bias"):
                t.zero_()
        _fill_codes(module, name, value)
    return bytes_read()


def _fill_codes(module: nn.Module, name: str, value: Callable[[str], torch.Tensor]) -> None:
    """A quantized layer's codes and scales from its full-precision weight(s)."""
    fmt = getattr(module, "fmt", None)
    quantize = fmt.quantize if fmt is not None else quantize_per_channel
    if hasattr(module, "qweight"):  # a linear layer
        module.qweight, module.scale = (t.to(module.qweight.device) for t in quantize(value(f"{name}.weight")))
    for leaf in ("w1", "w2", "w3"):  # routed experts
        if hasattr(module, f"q{leaf}"):
            codes, scale = quantize(value(f"{name}.{leaf}"))
            setattr(module, f"q{leaf}", codes.to(getattr(module, f"q{leaf}").device))
            setattr(module, f"{leaf}_scale", scale.to(codes.device))


def _source(cfg: RunConfig, init_from: str | None, shapes: dict[str, tuple[int, ...]]
            ) -> tuple[Callable[[str], torch.Tensor], Callable[[], int]]:
    """name -> the whole fp32 value of a base tensor (read from `init_from`, or its initial value from the
    seed), and the bytes read so far."""
    if init_from is None:
        with torch.device("meta"):
            reference = Transformer(cfg.model, init_seed=None)
        return (lambda key: reference.initial_value(key, cfg.train.seed)), (lambda: 0)
    if is_hf_directory(init_from):
        reader = HFSliceReader(init_from, cfg.model)
        check_hf_fits(reader, shapes, f"train.init_from={init_from!r}")
        return (lambda key: reader.read(key, (0,) * len(shapes[key]), shapes[key], torch.float32)), (
            lambda: reader.bytes_read)
    found = ckpt.verified(ckpt.resolve_checkpoint(init_from))
    ckpt.check_compatible(found, MODEL_PREFIX.rstrip("."), shapes)
    read = [0]

    def value(key: str) -> torch.Tensor:
        box = torch.empty(shapes[key], dtype=torch.float32)
        read[0] += ckpt.load_boxes(found, {MODEL_PREFIX + key: ((0,) * box.dim(), box)})
        return box

    return value, lambda: read[0]
