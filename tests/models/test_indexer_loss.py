"""DeepSeek-V3.2's indexer loss (tessera/models/attention_variants/indexer_loss.py) on a tiny model: each
sparse-attention layer's loss is the KL a direct, query-by-query float64 computation gives (the main
attention's head-summed distribution against the indexer's softmax, over all causal keys in the dense
warm-up and over the chosen keys in the sparse stage), its gradient reaches the indexer alone while the
language-model loss never does, and switching it on in the sparse stage leaves the logits as they are."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tessera.config import get_preset
from tessera.models.attention_variants.indexer_loss import IndexerTraining
from tessera.models.attention_variants.sparse_mla import SparseLatentAttention
from tessera.models.rope import apply_rope
from tessera.models.transformer import Transformer

S = 14  # longer than the preset's index_topk of 8, so the sparse stage chooses


def _model(stage: str | None, weight: float = 0.5) -> Transformer:
    model = Transformer(get_preset("tiny-deepseek-v32", init_std=0.3), init_seed=3)
    for m in model.modules():
        if isinstance(m, SparseLatentAttention):
            m.indexer_training = None if stage is None else IndexerTraining(weight, stage)
            m.indexer.requires_grad_(stage is not None)
    return model


def _ids(B: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(5))


def _hand_kl(att: SparseLatentAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stage: str) -> float:
    """The layer's loss before its weight, query by query in float64 from the formulas of the report."""
    with torch.no_grad():
        q, k, _, q_latent = att.project(x, cos, sin)
        ix = att.indexer
        B, H_i, D_i = x.shape[0], ix.n_heads, ix.head_dim
        iq = apply_rope((q_latent @ ix.wq_b.weight.T).view(B, S, H_i, D_i), cos, sin, False).double()
        keys = F.layer_norm(x @ ix.wk.weight.T, (D_i,), ix.k_norm.weight, ix.k_norm.bias, 1e-6)
        keys = apply_rope(keys.unsqueeze(2), cos, sin, False).squeeze(2).double()
        w = (x @ ix.weights_proj.weight.T).double() * H_i ** -0.5
    total = 0.0
    for b in range(B):
        for t in range(S):
            score = [sum(float(w[b, t, j]) * max(float(iq[b, t, j] @ keys[b, s]) / math.sqrt(D_i), 0.0)
                         for j in range(H_i)) for s in range(t + 1)]
            keep = range(t + 1) if stage == "dense" else sorted(
                sorted(range(t + 1), key=lambda s: -score[s])[:ix.topk])
            p = [0.0] * len(keep)
            for h in range(q.shape[1]):
                logits = [float(q[b, h, t].double() @ k[b, h, s].double()) * att.scale for s in keep]
                top = max(logits)
                e = [math.exp(v - top) for v in logits]
                p = [pi + ei / sum(e) for pi, ei in zip(p, e, strict=True)]
            p = [pi / sum(p) for pi in p]
            top = max(score[s] for s in keep)
            log_z = top + math.log(sum(math.exp(score[s] - top) for s in keep))
            total += sum(pi * (math.log(pi) - (score[s] - log_z)) for pi, s in zip(p, keep, strict=True) if pi > 0)
    return total / (B * S)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_each_layers_loss_is_the_hand_computed_kl(stage):
    model = _model(stage, weight=0.5)
    seen = {}

    def keep_input(module, args):
        seen[module.layer_id] = args[:3]

    for m in model.modules():
        if isinstance(m, SparseLatentAttention):
            m.register_forward_pre_hook(keep_input)
    out = model(_ids())
    assert {f"layer{i}/indexer_kl" for i in range(3)} <= set(out.aux_losses)
    for i in range(3):
        want = 0.5 * _hand_kl(model.layers[str(i)].attention, *seen[i], stage)
        got = float(out.aux_losses[f"layer{i}/indexer_kl"].detach())
        assert want > 1e-3
        assert abs(got - want) <= 1e-5 * want + 1e-7, (i, got, want)
    kl = sum(float(out.aux_losses[f"layer{i}/indexer_kl"].detach()) for i in range(3))
    assert float(out.aux_loss.detach()) >= kl - 1e-6  # the objective's auxiliary sum carries it


def test_the_loss_trains_the_indexer_alone_and_the_language_model_loss_never_does():
    model = _model("sparse")
    out = model(_ids())
    indexer = {n for n, _ in model.named_parameters() if ".indexer." in n}
    assert indexer and all(p.requires_grad for n, p in model.named_parameters() if n in indexer)
    kl = sum(v for k, v in out.aux_losses.items() if k.endswith("indexer_kl"))
    kl.backward(retain_graph=True)
    for name, p in model.named_parameters():
        if name in indexer:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or not p.grad.any(), name
    model.zero_grad(set_to_none=True)
    F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), _ids().reshape(-1)).backward()
    assert all(p.grad is None or not p.grad.any() for n, p in model.named_parameters() if n in indexer)
    assert model.layers["0"].attention.wq_b.weight.grad.abs().sum() > 0


def test_the_sparse_stage_keeps_the_logits_and_the_dense_stage_attends_to_every_key():
    ids = _ids()
    with torch.no_grad():
        plain = _model(None)(ids).logits
        torch.testing.assert_close(_model("sparse")(ids).logits, plain, rtol=0, atol=0)
        dense = _model("dense")(ids).logits
        cfg = get_preset("tiny-deepseek-v32", init_std=0.3)
        wide = type(cfg)(**{**vars(cfg), "mla": {**vars(cfg.mla), "index_topk": S}})
        torch.testing.assert_close(dense, Transformer(wide, init_seed=3)(ids).logits, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(dense, plain, atol=1e-4)
