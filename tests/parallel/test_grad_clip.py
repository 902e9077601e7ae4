"""Gradient clipping: the single-process path equals torch's clip_grad_norm_; under a layout
the norm counts every parameter of every rank once (the layout tests compare it with one
process for FSDP, HSDP, TP, SP and EP)."""

import math

import pytest
import torch

from tessera.config import get_preset
from tessera.models import Transformer
from tessera.parallel import clip_grad_norm_, grad_norm


def _model_with_grads() -> Transformer:
    cfg = get_preset("tiny-llama")
    model = Transformer(cfg, init_seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    model(tokens).logits.square().mean().backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_matches_torch_clip_grad_norm(norm_type):
    a, b = _model_with_grads(), _model_with_grads()
    ours = clip_grad_norm_(a.parameters(), 0.01, None, norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.01, norm_type)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-12)
    assert grad_norm(a.parameters(), None, norm_type) <= 0.01 * (1 + 1e-4)


def test_no_clipping_below_max_norm():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm_(model.parameters(), 1e9)
    assert norm > 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
