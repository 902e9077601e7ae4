"""Log-probabilities of chosen tokens and the most likely ones, computed on the device and brought
to the host with the step's other values.

They are of the model's raw distribution, log_softmax of the logits before any bias, penalty,
grammar mask, temperature or cut, as vLLM returns by default ("raw_logprobs"). The fp32 values
travel through the step's one integer transfer (`HostTransfer`) as their bit patterns.
Shapes: R rows, V vocabulary, K top tokens.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """One position: the token there (sampled, or given in the prompt), its log-probability and
    the most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """fp32 values as int64 holding their 32-bit patterns (for an integer transfer)."""
    return values.float().contiguous().view(torch.int32).long()


def bits_float(values: list[int]) -> list[float]:
    """The fp32 values whose bit patterns `float_bits` gave (read on the host: a request's row or two a
    step, where making tensors of them cost more than the step's sampling)."""
    return list(struct.unpack(f"{len(values)}f", struct.pack(f"{len(values)}i", *values)))


@dataclass
class LogprobRows:
    """Rows of one request whose chosen tokens' log-probabilities are asked, filed under `key`."""

    key: Hashable
    rows: list[int]  # rows of the step's logits
    top_k: int  # most likely tokens to report per row


def raw_logprobs(logits_TV: torch.Tensor, asks: list[LogprobRows]) -> torch.Tensor | None:
    """fp32 log_softmax [R, V] of the rows of every ask, in order (None when none asks)."""
    if not asks:
        return None
    index = torch.tensor([r for a in asks for r in a.rows]).to(logits_TV.device, non_blocking=True)
    return torch.log_softmax(logits_TV.index_select(0, index).float(), dim=-1)


def add_logprobs(transfer, logp_RV: torch.Tensor, asks: list[LogprobRows], chosen_R: torch.Tensor) -> int:
    """Add to `transfer` (a HostTransfer) the chosen tokens `chosen_R` (one per row of every ask,
    in order, on the device), their log-probabilities in `logp_RV` and each row's top tokens.
    Returns how many top tokens each row brings (the largest any ask wants)."""
    def keys(what: str, per_row: int = 1) -> list:
        return [(a.key, what) for a in asks for _ in a.rows for _ in range(per_row)]

    transfer.add(chosen_R, keys("chosen"))
    transfer.add(float_bits(logp_RV.gather(1, chosen_R[:, None])[:, 0]), keys("logprob"))
    k = max(a.top_k for a in asks)
    if k > 0:
        values_RK, ids_RK = torch.topk(logp_RV, k, dim=-1)
        transfer.add(ids_RK.reshape(-1), keys("top_ids", k))
        transfer.add(float_bits(values_RK.reshape(-1)), keys("top_values", k))
    return k


def read_logprobs(host: dict, ask: LogprobRows, k_max: int) -> list[TokenLogprobs]:
    """The `TokenLogprobs` of `ask`'s rows from the fetched transfer `host` (`k_max`: the top count
    that `gather_logprobs` used for the step)."""
    chosen, logprobs = host[(ask.key, "chosen")], bits_float(host[(ask.key, "logprob")])
    ids = host.get((ask.key, "top_ids"), [])
    values = bits_float(host[(ask.key, "top_values")]) if ids else []
    out = []
    for r, (token, lp) in enumerate(zip(chosen, logprobs)):
        top = list(zip(ids[r * k_max:r * k_max + ask.top_k], values[r * k_max:r * k_max + ask.top_k]))
        out.append(TokenLogprobs(token, lp, top))
    return out
