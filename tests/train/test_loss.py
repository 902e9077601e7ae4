"""The global-batch loss normalisation: accumulated micro-batches give one big batch's gradient."""

from __future__ import annotations

import torch

from tessera.config import get_preset
from tessera.models import Transformer
from tessera.train.objectives.loss import count_loss_tokens, micro_batch_objective, token_loss_sum


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _setup():
    cfg = get_preset("tiny-llama")
    model = Transformer(cfg, init_seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=g)
    # Loss masks with very different counts per micro-batch (as SFT answers give): 2 rows each.
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[0, 10:] = True   # 6 tokens
    mask[1, 15:] = True   # 1 token
    mask[2, :] = True     # 16 tokens
    mask[3, 3:12] = True  # 9 tokens
    return model, tokens[:, :-1], tokens[:, 1:], mask


def test_accumulated_gradient_equals_big_batch_gradient():
    model, x, y, mask = _setup()
    n = count_loss_tokens(y, mask)
    assert n == 32
    (token_loss_sum(model(x).logits, y, mask) / n).backward()
    big = _grads(model)
    model.zero_grad()
    for rows in (slice(0, 2), slice(2, 4)):
        out = model(x[rows])
        micro_batch_objective(token_loss_sum(out.logits, y[rows], mask[rows]), out.aux_loss, n, 2).backward()
    accumulated = _grads(model)
    assert big.keys() == accumulated.keys()
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], rtol=1e-5, atol=1e-7, msg=name)

    # The tempting alternative, a mean of per-micro-batch means, gives another gradient here.
    model.zero_grad()
    for rows in (slice(0, 2), slice(2, 4)):
        micro_sum = token_loss_sum(model(x[rows]).logits, y[rows], mask[rows])
        (micro_sum / count_loss_tokens(y[rows], mask[rows]) / 2).backward()
    mean_of_means = _grads(model)
    assert not torch.allclose(mean_of_means["output.weight"], big["output.weight"], rtol=1e-3)


def test_token_loss_sum_ignores_masked_positions():
    model, x, y, mask = _setup()
    logits = model(x).logits
    y_changed = y.clone()
    y_changed[~mask] = (y_changed[~mask] + 1) % logits.shape[-1]  # targets outside the mask do not matter
    assert torch.equal(token_loss_sum(logits, y, mask), token_loss_sum(logits, y_changed, mask))
    full = token_loss_sum(logits, y, torch.ones_like(mask))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
    torch.testing.assert_close(full, ref)


def test_aux_loss_is_averaged_over_micro_batches():
    loss_sum, aux = torch.tensor(10.0), torch.tensor(0.3)
    assert float(micro_batch_objective(loss_sum, aux, 20, 3)) == float(torch.tensor(10.0) / 20 + aux / 3)
