"""Multi-token prediction (MTP), DeepSeek-V3's design (DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report", section 2.2), as `model.mtp_depth` D modules after the main model's last layer.

Module k (1..D) at position i combines the previous depth's hidden state h^{k-1}_i (depth 0: the
main model's last hidden state, before its final norm) with the embedding of token i+k:

    h'^k_i = M_k [RMSNorm_h(h^{k-1}_i) ; RMSNorm_e(Emb(t_{i+k}))]     (M_k: 2d -> d, `eh_proj`)
    h^k_i  = Block_k(h'^k_i)                                          (one block of the model's family)
    P^k_i  = Head(RMSNorm_k(h^k_i))                                   predicts t_{i+k+1}

Emb and Head are the main model's own (shared, not copied); each module has its own final norm
(DeepSeek-V3's checkpoints name it `shared_head.norm`). The concatenation puts the embedding first,
as those checkpoints' `eh_proj` expects. Positions keep the main model's: the block attends
causally over the same sequence, so h^k_i sees tokens up to i+k and its target is i+k+1.

Over a micro-batch of sequences of length S, depth k takes the input ids shifted left by k (the
last k positions, which have no token i+k in the row, embed token 0) and the targets shifted
left by k (those positions get IGNORE_INDEX: no loss). The tensors keep length S, so sequence
parallelism cuts them like the main model's. Only token ids move: the hidden state h^{k-1}_i stays
at position i. Under context parallelism a rank holds only some positions of each sequence (its
chunk, or its two zig-zag chunks), and token i+k may sit on another rank; the model therefore
shifts through a seam, `TokenSequence` (the Transformer's `mtp_sequence`): on one process the ids
are already the whole sequence; context parallelism installs one that all-gathers every rank's
ids into sequence order (`whole`), shifts there and keeps this rank's positions (`own`). The
ids are integers, so the exchange is exact and carries no gradient. The training loss is

    L_MTP = lambda / D * sum_k sum_t CE_k,t / N

(N: the main loss's tokens of the global batch, as every loss of tessera/train/objectives/loss.py), added to
the main loss.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.models.chunked_cross_entropy import IGNORE_INDEX
from tessera.models.norm import RMSNorm


def shift_left(t_BS: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """`t` moved k positions left along the sequence, the last k positions filled with `fill`."""
    S = t_BS.shape[1]
    pad = t_BS.new_full((t_BS.shape[0], min(k, S)), fill)
    return torch.cat([t_BS[:, k:], pad], dim=1)


def depth_inputs(input_ids_BS: torch.Tensor, k: int) -> torch.Tensor:
    """Token i+k at position i (token 0 where the row has none)."""
    return shift_left(input_ids_BS, k, 0)


def depth_targets(targets_BS: torch.Tensor, k: int) -> torch.Tensor:
    """Token i+k+1 at position i (IGNORE_INDEX where the row has none)."""
    return shift_left(targets_BS, k, IGNORE_INDEX)


class TokenSequence:
    """The Transformer's `mtp_sequence` seam on one process: the ids it holds are the whole sequence."""

    def whole(self, t_BS: torch.Tensor) -> torch.Tensor:
        """Every position of the held sequences, in sequence order, from this process's ids."""
        return t_BS

    def own(self, t_BS: torch.Tensor) -> torch.Tensor:
        """This process's positions of a whole-sequence tensor, in the order it holds them."""
        return t_BS


class MTPModule(nn.Module):
    """One depth k: the two input norms, the projection M_k, a block of the model's family (built
    by the Transformer with layer id n_layers + k - 1, so its MoE placement follows the model's
    rule) and the module's final norm."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(dim, norm_eps)
        self.hnorm = RMSNorm(dim, norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, norm_eps)

    def forward(self, h_prev_BSD: torch.Tensor, emb_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache=None):
        """(h^k before its final norm [B, S, D], the block's router output or None)."""
        x = self.eh_proj(torch.cat([self.enorm(emb_BSD), self.hnorm(h_prev_BSD)], dim=-1))
        return self.block(x, cos, sin, cache)
