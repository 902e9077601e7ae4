"""What the calibration data says about the inputs of each linear layer, gathered with forward hooks:
their second moment X^T X (GPTQ's Hessian) and their largest magnitude per input channel
(SmoothQuant's activation scale), in float64 whatever the model's dtype.

`quantize_blocks` runs the calibration sequences through the model one transformer block at a
time: every linear layer of block i is measured on block i's inputs, the block is quantized by the
caller (which puts the dequantized weights in place), and block i + 1 then measures what the
*quantized* block i outputs, so each block's quantization corrects for the error of the ones before
(as the GPTQ paper's sequential procedure does). Inside a block all layers see the inputs the
unquantized block gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tessera.models.transformer import Transformer

BATCH = 4  # calibration sequences per forward pass


@dataclass
class InputStatistics:
    """The inputs one linear layer received: sum of x x^T, row count, per-channel max |x|."""

    xtx: torch.Tensor  # [in, in] float64
    absmax: torch.Tensor  # [in] float64
    rows: int = 0

    @classmethod
    def empty(cls, in_features: int) -> InputStatistics:
        return cls(torch.zeros(in_features, in_features, dtype=torch.float64),
                   torch.zeros(in_features, dtype=torch.float64))

    def add(self, x: torch.Tensor, hessian: bool) -> None:
        x = x.reshape(-1, x.shape[-1]).double()  # [tokens, in]
        if hessian:
            self.xtx += x.T @ x
        self.absmax = torch.maximum(self.absmax, x.abs().amax(0))
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """H = 2 X^T X / n (GPTQ's layer-wise Hessian)."""
        return 2.0 * self.xtx / max(self.rows, 1)


@contextmanager
def recording_inputs(layers: dict[str, nn.Linear], hessian: bool) -> Iterator[dict[str, InputStatistics]]:
    """While open, every forward call of `layers` adds its input to the yielded statistics."""
    stats = {name: InputStatistics.empty(m.in_features) for name, m in layers.items()}
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: stats[name].add(args[0], hessian))
               for name, m in layers.items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


def block_linears(model: Transformer, key: str) -> dict[str, nn.Linear]:
    """The linear layers of block `key` by their full module name ("layers.0.attention.wq")."""
    return {f"layers.{key}.{n}": m for n, m in model.layers[key].named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def input_absmax(model: Transformer, tokens_NS: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every block linear layer over the calibration tokens, by name."""
    model.eval()
    layers = {n: m for key in model.layers for n, m in block_linears(model, key).items()}
    with recording_inputs(layers, hessian=False) as stats:
        for batch in tokens_NS.split(BATCH):
            model(batch)
    return {name: s.absmax for name, s in stats.items()}


@torch.no_grad()
def quantize_blocks(model: Transformer, tokens_NS: torch.Tensor,
                    quantize_block: Callable[[dict[str, nn.Linear], dict[str, InputStatistics]], None]) -> None:
    """Block by block (module docstring): `quantize_block(linears, statistics)` for each block, given
    its linear layers and their inputs' statistics; it must leave the dequantized weights in place."""
    model.eval()
    batches = tokens_NS.split(BATCH)
    hidden = [model.tok_embeddings(b) for b in batches]  # [B, S, D] each
    B, S = batches[0].shape
    dtype = hidden[0].dtype
    positions = model.position_source(B, S, tokens_NS.device)
    tables = model.rope_tables(positions, dtype)

    def rope(h: torch.Tensor, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = tables.of_layer(model.cfg, layer_id)
        return cos[:h.shape[0]], sin[:h.shape[0]]  # the last batch may be smaller

    for key, block in model.layers.items():
        linears = block_linears(model, key)
        with recording_inputs(linears, hessian=True) as stats:
            for h in hidden:
                block(h, *rope(h, int(key)))
        quantize_block(linears, stats)
        hidden = [block(h, *rope(h, int(key)))[0] for h in hidden]
