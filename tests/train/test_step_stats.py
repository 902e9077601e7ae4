"""A step's statistics are summed on the device and read on the host once per step: the
micro-batch loop itself reads no value from the device (`aten._local_scalar_dense` is what
`float(t)`, `.item()` and `int(t)` run), and the settled figures are the sums of the parts."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.train.objectives.loss import token_loss_sum
from tessera.train.steps.step_engine import accumulate_micro_batches
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config,shrink_fn", [(TINY_DENSE, shrink), (TINY_MOE, moe_shrink)], ids=["dense", "moe"])
def test_micro_batch_loop_reads_nothing_on_the_host_until_the_step_is_settled(config, shrink_fn):
    model = Transformer(load_config(config, shrink_fn("unused", "unused", 1)).model, init_seed=0).train()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.cfg.vocab_size, (4, 16), generator=gen)
    y = torch.randint(0, model.cfg.vocab_size, (4, 16), generator=gen)
    with HostReads() as reads:
        stats = accumulate_micro_batches(model, x, y, 2, 64, 2, torch.device("cpu"), None)
    assert reads.count == 0
    assert stats.pending and stats.loss_sum == 0.0
    stats.settle()
    assert not stats.pending
    with torch.no_grad():
        outs = [model(x[i:i + 2]) for i in (0, 2)]
    want = sum(float(token_loss_sum(o.logits, y[i:i + 2]).double()) for o, i in zip(outs, (0, 2), strict=True))
    assert stats.loss_sum == pytest.approx(want, rel=1e-6)
    assert stats.aux_total == pytest.approx(sum(float(o.aux_loss) for o in outs), rel=1e-6, abs=1e-9)
    if "moe" in config:
        assert stats.aux_parts and set(stats.aux_parts) == set(outs[0].aux_losses)
