"""gpt-oss's experts kept in MXFP4 for serving: the gate, up and down matrices as a GGUF file
stores them (llama.cpp's blocks: an E8M0 scale byte and 32 E2M1 codes per 17 bytes,
models/gguf_blocks.py), about a quarter of bf16's bytes, dequantized one expert at a time inside
the forward and only for the experts rows were routed to.

    gate_blocks [E, F, D/32*17], up_blocks [E, F, D/32*17], down_blocks [E, D, F/32*17]: uint8
    gate_up_proj_bias [E, 2F] (gate and up interleaved, as `BiasedExperts`), down_proj_bias [E, D]

Each expert computes what `BiasedExperts` computes on its rows (gate and up interleaved into one
product for the clamped SwiGLU), so a model holding these equals the one dequantized at load. The
rows come sorted by expert as `GroupedExperts` takes them; rows past the last expert's come out
zero. The blocks are buffers (nothing trains them): expert parallelism refuses these experts as it
refuses every `quantized` one (tessera/parallel/expert_parallel.py). N rows, D model dim, F hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.gguf_blocks import dequantize, row_bytes
from tessera.models.moe.biased_experts import clamped_swiglu
from tessera.models.moe.experts import each_expert_on_its_rows


class Mxfp4Experts(nn.Module):
    quantized = True  # not quantizable again, not cut by expert parallelism

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, alpha: float, limit: float,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        E, D, Fh = num_experts, dim, hidden_dim
        self.num_experts, self.dim, self.hidden_dim, self.alpha, self.limit = E, D, Fh, alpha, limit
        for name, out_f, in_f in (("gate", Fh, D), ("up", Fh, D), ("down", D, Fh)):
            self.register_buffer(f"{name}_blocks", torch.empty(E, out_f, row_bytes("MXFP4", in_f), dtype=torch.uint8))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * Fh, dtype=dtype), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(E, D, dtype=dtype), requires_grad=False)

    def _weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        blocks = getattr(self, f"{name}_blocks")[e]
        return dequantize("MXFP4", blocks, (blocks.shape[0], blocks.shape[1] // 17 * 32)).to(dtype)

    def expert(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows: [n, D] -> [n, D]."""
        b_gu = self.gate_up_proj_bias[e].to(x_ND.dtype)
        gate = F.linear(x_ND, self._weight("gate", e, x_ND.dtype), b_gu[0::2])
        up = F.linear(x_ND, self._weight("up", e, x_ND.dtype), b_gu[1::2])
        h = torch.stack([gate, up], dim=-1).flatten(-2)  # interleaved, as BiasedExperts' product
        act = clamped_swiglu(h, self.alpha, self.limit)
        return F.linear(act, self._weight("down", e, x_ND.dtype), self.down_proj_bias[e].to(x_ND.dtype))

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return each_expert_on_its_rows(self.expert, x_ND, tokens_per_expert, self.dim)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}, MXFP4"
