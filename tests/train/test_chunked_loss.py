"""The chunked LM-head loss: equal to the plain loss (fp32 1e-6, values and gradients), never an
op output as large as the micro-batch's full-vocabulary logits, wired through the model's loss
seam, the fp16 loss scaler and the trainer (`train.loss_chunk_tokens`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config import ConfigError
from tessera.config.schema import load_config
from tessera.models import ModelInput, Transformer
from tessera.models.chunked_cross_entropy import IGNORE_INDEX, chunked_linear_cross_entropy
from tessera.train.objectives.loss import token_loss_sum
from tessera.train.precision import loss_chunk_tokens
from tessera.train.steps.loss_scaler import DynamicLossScaler
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink


class LargestOutput(TorchDispatchMode):
    """Records the most elements any op produced while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _problem(T=37, D=16, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, V, (T,), generator=g)
    y[::5] = IGNORE_INDEX
    return h, w, y


def _plain(h, w, y):
    return F.cross_entropy((h @ w.T).float(), y, ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 7, 37, 100])
def test_chunked_loss_equals_the_plain_loss_in_value_and_gradient(chunk):
    h, w, y = _problem()
    want = _plain(h, w, y)
    gh, gw = torch.autograd.grad(want * 3.0, (h, w))
    got = chunked_linear_cross_entropy(h, w, y, chunk)
    ch, cw = torch.autograd.grad(got * 3.0, (h, w))  # a non-unit upstream gradient flows through
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ch, gh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cw, gw, rtol=1e-6, atol=1e-6)
    assert ch[::5].abs().max() == 0  # ignored positions get no gradient


def test_no_op_ever_holds_the_whole_micro_batchs_logits():
    h, w, y = _problem(T=64, D=8, V=200)
    with LargestOutput() as plain:
        _plain(h, w, y).backward()
    assert plain.largest >= 64 * 200  # the probe sees the full logits of the plain loss
    with LargestOutput() as chunked:
        chunked_linear_cross_entropy(h, w, y, 8).backward()
    assert chunked.largest <= 8 * 200, chunked.largest


def test_chunked_loss_under_bf16_autocast_follows_the_plain_head():
    h, w, y = _problem(T=40, D=32, V=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, w).float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
        got = chunked_linear_cross_entropy(h, w, y, 16)
    gh, gw = torch.autograd.grad(want, (h, w))
    ch, cw = torch.autograd.grad(got, (h, w))
    assert got.dtype == torch.float32 and cw.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(ch, gh, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(cw, gw, rtol=2e-2, atol=2e-3)


def test_bad_chunk_is_refused():
    h, w, y = _problem()
    with pytest.raises(ValueError, match="chunk must be a positive number of tokens"):
        chunked_linear_cross_entropy(h, w, y, 0)


def _model(tie: bool, config=TINY_DENSE, shrink_fn=shrink) -> Transformer:
    extra = {"model.tie_embeddings": True} if tie else {}
    return Transformer(load_config(config, shrink_fn("unused", "unused", 1, **extra)).model, init_seed=0)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_model_loss_seam_returns_the_chunked_loss_and_its_gradients(tie):
    model = _model(tie)
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    y = torch.randint(0, model.cfg.vocab_size, (2, 12))
    y[0, :3] = IGNORE_INDEX
    out = model(ModelInput(tokens=x, targets=y))  # off by default: logits, as serving and the HF parity tests expect
    assert out.loss_sum is None and out.logits.shape == (2, 12, model.cfg.vocab_size)
    want = token_loss_sum(out.logits, y)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.loss_chunk_tokens = 5
    out = model(ModelInput(tokens=x, targets=y))
    assert out.logits is None
    out.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum, want, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-6, atol=1e-6, msg=n)
    assert model(x).logits is not None  # without targets (serving, generation): logits


def test_fp16_loss_scaler_scales_the_chunked_loss():
    model = _model(False)
    model.loss_chunk_tokens = 8
    scaler = DynamicLossScaler(scale=1024.0)
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    y = torch.randint(0, model.cfg.vocab_size, (2, 12))
    model(ModelInput(tokens=x, targets=y)).loss_sum.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    scaler.scale_loss(model(ModelInput(tokens=x, targets=y)).loss_sum).backward()
    head = model.output.weight.grad
    torch.testing.assert_close(head, plain["output.weight"] * 1024.0, rtol=1e-5, atol=1e-6)
    scaler.unscale_([model])
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-7, msg=n)


def test_loss_chunk_tokens_default_is_on_for_cuda_only_and_negative_is_refused(tmp_path):
    assert loss_chunk_tokens(None, torch.device("cpu")) == 0
    assert loss_chunk_tokens(None, torch.device("cuda", 0)) > 0
    assert loss_chunk_tokens(64, torch.device("cpu")) == 64
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens=-1 is invalid"):
        load_config(TINY_DENSE, shrink("unused", tmp_path, 1, **{"train.loss_chunk_tokens": -1}))


@pytest.mark.parametrize("config,shrink_fn", [(TINY_DENSE, shrink), (TINY_MOE, moe_shrink)], ids=["dense", "moe"])
def test_trainer_with_chunked_loss_follows_the_plain_loss(small_dataset, tmp_path, config, shrink_fn):
    """Three steps of the trainer (accumulation 2, eval) with chunks of 24 of the 64 tokens of a
    micro-batch: losses and the evaluation equal within fp32 1e-5 of the plain loss."""
    losses, evals = {}, {}
    for chunk in (0, 24):
        trainer = Trainer(load_config(config, shrink_fn(small_dataset, tmp_path / str(chunk), 3, **{
            "train.loss_chunk_tokens": chunk, "checkpoint.interval": 0})))
        assert trainer.model.loss_chunk_tokens == chunk
        losses[chunk] = [r["loss"] for r in trainer.train().records]
        evals[chunk] = trainer.engine.evaluate([trainer.data.train.next_batch()])
    assert len(losses[24]) == 3
    for got, want in zip(losses[24], losses[0], strict=True):
        assert abs(got - want) <= 1e-5 * want, (losses[24], losses[0])
    assert evals[24][1] == evals[0][1] and abs(evals[24][0] - evals[0][0]) <= 1e-5 * evals[0][0]


def test_fp16_trainer_with_chunked_loss_follows_the_plain_loss(small_dataset, tmp_path):
    """Loss scaling reaches the chunked loss: fp16 runs with and without chunks agree, no step skipped."""
    losses = {}
    for chunk in (0, 24):
        trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / str(chunk), 3, **{
            "train.loss_chunk_tokens": chunk, "train.dtype": "fp16", "checkpoint.interval": 0})))
        records = trainer.train().records
        assert all("skipped_step" not in r for r in records)
        losses[chunk] = [r["loss"] for r in records]
    for got, want in zip(losses[24], losses[0], strict=True):
        assert abs(got - want) <= 1e-3 * want, (losses[24], losses[0])
