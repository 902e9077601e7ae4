"""Low-rank adapters on a model's linear layers, for training (`train.lora`, tessera.config.adapters.lora).

A targeted layer (an `nn.Linear`, or a quantized one: Int8Linear, Int4Linear) keeps its weights and
names and gains two small modules and a forward hook:

    layers.0.attention.wq.weight           the base, frozen
    layers.0.attention.wq.lora_A.weight    A [r, in], trained
    layers.0.attention.wq.lora_B.weight    B [out, r], trained
    y = base(x) + s * B (A dropout(x))     (`adapter_output`, the hook)

which is PEFT's LoraLayer with its `default` adapter (the names differ from PEFT's by that word:
tessera.checkpoint.hf.peft maps them). The layer stays what it was, so the checkpoint names, the
HuggingFace names and the parallel plans of the base are unchanged; tensor parallelism cuts A and B to
match the base (tessera.parallel.tensor_parallel: a column-parallel layer's B by rows, a row-parallel
layer's A by columns) and fills the seam `lora_delta` (the adapter's product, `adapter_delta` in one
process) with one whose replicated factor's gradient is whole on every rank. The hook reads everything
from the module it is called on, so a copied module (pipeline stages) carries its own.

Initialisation is by name from the run's seed, as every tensor of the model (`Transformer.initial_value`
asks the factor): A from U(-1/sqrt(in), 1/sqrt(in)), the bound of PEFT's kaiming-uniform with a = sqrt(5),
and B zero, so a fresh adapter leaves the model's outputs as they were.

`add_adapters` freezes the whole model first (no gradient, so no optimizer state), then adds the
adapters, which train; `modules_to_save` (the embedding, the head) train whole beside them.
`quantize_base` (QLoRA) replaces the blocks' linear layers by their int8 / int4 versions first
(tessera.models.quantized.quantize_model), before the adapters are added on top of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.errors import ConfigError
from tessera.models.transformer import name_seed

FACTORS = ("lora_A", "lora_B")


class AdapterFactor(nn.Module):
    """A or B of one adapter: a bias-free product with `weight` [out, in]. Not an `nn.Linear`, so
    nothing that converts, quantizes or parallelizes linear layers takes it for a base layer."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """The fp32 CPU value of this factor's weight `name` (its full name in the model) from `seed`:
        A uniform in +-1/sqrt(in), B zero (module docstring)."""
        if name.endswith("lora_B.weight"):
            return torch.zeros(self.out_features, self.in_features)
        gen = torch.Generator().manual_seed(name_seed(seed, name))
        bound = 1.0 / math.sqrt(self.in_features)
        return torch.empty(self.out_features, self.in_features).uniform_(-bound, bound, generator=gen)


def adapter_delta(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """s * B (A dropout(x)) of adapted layer `module`: the `lora_delta` seam's one-process product."""
    return module.lora_B(module.lora_A(module.lora_dropout(x))) * module.lora_scaling


def adapter_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The forward hook of an adapted layer: its output plus its adapter's product (`lora_delta`)."""
    return output + module.lora_delta(module, inputs[0])


def layer_sides(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer, plain or quantized."""
    return module.in_features, module.out_features


def add_adapter(module: nn.Module, name: str, rank: int, scaling: float, dropout: float) -> None:
    """Give linear layer `module` (called `name` in the model) an adapter of `rank`, on its weights' device."""
    in_f, out_f = layer_sides(module)
    if rank > min(in_f, out_f):
        raise ConfigError(f"train.lora.rank={rank} is invalid: {name} is {out_f}x{in_f}, so the rank must be at "
                          f"most {min(in_f, out_f)}")
    device = next(t.device for t in list(module.parameters()) + list(module.buffers()))
    module.lora_A = AdapterFactor(in_f, rank, device)
    module.lora_B = AdapterFactor(rank, out_f, device)
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.lora_scaling = scaling
    # the seam (module docstring): (layer, x) -> s * B (A dropout(x)); tensor parallelism installs its own
    module.lora_delta = adapter_delta
    module.register_forward_hook(adapter_output)


def add_adapters(model: nn.Module, targets: list[str], rank: int, scaling: float, dropout: float = 0.0,
                 trained_whole: list[str] = (), seed: int | None = None) -> list[str]:
    """Freeze `model`, then adapt each module named in `targets` (`add_adapter`) and make the modules
    `trained_whole` trainable again; returns the adapters' parameter names. With `seed` the adapters
    are initialised by name from it (`init_adapters`); without, they are left for the caller to fill
    (a meta model, materialised later by name)."""
    modules = dict(model.named_modules())
    for name in targets:
        if name not in modules or not hasattr(modules[name], "in_features"):
            raise ConfigError(f"train.lora.target_modules: {name} is not a linear layer of this model")
    model.requires_grad_(False)
    for name in targets:
        add_adapter(modules[name], name, rank, scaling, dropout)
    for name in trained_whole:
        modules[name].requires_grad_(True)
    if seed is not None:
        init_adapters([model], seed)
    return adapter_parameter_names(model)


def adapter_parameter_names(model: nn.Module) -> list[str]:
    """The names of `model`'s adapter weights (`<layer>.lora_A.weight`, `<layer>.lora_B.weight`)."""
    return [n for n, _ in model.named_parameters() if is_adapter_parameter(n)]


def is_adapter_parameter(name: str) -> bool:
    return any(f".{f}." in f".{name}" for f in FACTORS)


@torch.no_grad()
def init_adapters(parts: list[nn.Module], seed: int) -> None:
    """Set every adapter factor of `parts` (allocated; DTensors keep their shard) by name from `seed`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for part in parts:
        for name, module in part.named_modules():
            if not isinstance(module, AdapterFactor):
                continue
            p = module.weight
            full = module.initial_value(f"{name}.weight", seed).to(p.device if not isinstance(p, DTensor)
                                                                     else p.to_local().device)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every layer of `model` that carries an adapter."""
    return {n: m for n, m in model.named_modules() if isinstance(getattr(m, "lora_A", None), AdapterFactor)}


def merged_delta(A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """s * B A in fp32: what merging an adapter adds to its layer's weight."""
    return (B.float() @ A.float()) * scaling
