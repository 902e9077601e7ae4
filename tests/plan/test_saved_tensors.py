"""The measuring instrument itself: what `SavedTensorCounter` counts and what it leaves out."""

from __future__ import annotations

import torch
from torch import nn

from tessera.plan.saved_tensors import SavedTensorCounter


def test_a_storage_saved_twice_counts_once():
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensorCounter() as c:
        y = (x * x).sum()  # mul saves x for both operands
    y.backward()
    assert c.total_bytes == 8 * 16 * 4


def test_a_view_counts_its_whole_storage():
    x = torch.randn(8, 16, requires_grad=True)
    base = x * 2
    with SavedTensorCounter() as c:
        y = (base[:, :4].sin()).sum()  # sin saves its input, a view of `base`
    y.backward()
    assert c.total_bytes == 8 * 16 * 4


def test_parameters_and_their_autocast_copies_are_model_state():
    lin = nn.Linear(16, 32, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorCounter(lin) as c:
        y = lin(x).sum()
    y.backward()
    assert c.total_bytes == 4 * 16 * 4  # the input, not the weight
    with SavedTensorCounter(lin) as c, torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x).float().sum()
    y.backward()
    assert c.total_bytes == 4 * 16 * 2  # the bf16 copy of the input; the weight's bf16 copy is excluded


def test_what_autograd_frees_before_backward_is_not_counted():
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensorCounter() as c:
        idx = (x * 3).topk(2, dim=-1).indices  # values unused: the topk node and its saved indices die
        y = x.gather(1, idx).sum()  # gather keeps x and idx
    y.backward()
    assert c.total_bytes == 8 * 16 * 4 + 8 * 2 * 8
