"""Weight-decay grouping: matrices decay; norms, biases and embeddings do not (configurable)."""

from __future__ import annotations

import torch

from tessera.config import get_preset
from tessera.config.schema import OptimConfig
from tessera.models import Transformer
from tessera.train.optimizer import build_optimizer, weight_decay_groups


def _names(model, cfg):
    decay, no_decay = weight_decay_groups(model, cfg)
    return set(decay["names"]), set(no_decay["names"])


def test_default_groups_on_a_moe_model():
    model = Transformer(get_preset("tiny-moe", qkv_bias=True))
    decay, no_decay = _names(model, OptimConfig())
    assert "tok_embeddings.weight" in no_decay
    assert "norm.weight" in no_decay and "layers.0.attention_norm.weight" in no_decay
    assert "layers.0.attention.wq.bias" in no_decay
    for name in ("output.weight", "layers.0.attention.wq.weight", "layers.1.moe.experts.w1",
                 "layers.1.moe.router.weight"):
        assert name in decay, name
    all_names = {n for n, _ in model.named_parameters()}
    assert decay | no_decay == all_names and not decay & no_decay
    assert all(p.ndim >= 2 for n, p in model.named_parameters() if n in decay)


def test_patterns_and_vectors_are_configurable():
    model = Transformer(get_preset("tiny-llama"))
    decay, no_decay = _names(model, OptimConfig(no_decay=[], decay_vectors=True))
    assert "tok_embeddings.weight" in decay and "norm.weight" in decay and not no_decay
    decay, no_decay = _names(model, OptimConfig(no_decay=["output.*", "*.wq.*"]))
    assert "output.weight" in no_decay and "layers.1.attention.wq.weight" in no_decay
    assert "tok_embeddings.weight" in decay  # the default pattern was replaced


def test_tied_embedding_is_one_parameter():
    model = Transformer(get_preset("tiny-llama", tie_embeddings=True))
    decay, no_decay = _names(model, OptimConfig())
    assert "tok_embeddings.weight" in no_decay and "output.weight" not in decay | no_decay


def test_decay_applies_only_to_the_decay_group():
    model = Transformer(get_preset("tiny-llama"))
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a zero gradient: only the decoupled decay moves weights
    opt.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["output.weight"], before["output.weight"] * (1 - 0.1 * 0.5))
    assert torch.equal(after["tok_embeddings.weight"], before["tok_embeddings.weight"])
    assert torch.equal(after["norm.weight"], before["norm.weight"])
