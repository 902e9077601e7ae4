"""Activation recomputation: gradients bit-identical to no recomputation, names unchanged, and the
chosen pieces really run again in backward (counted at the operator level)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config import ParallelError, get_preset
from tessera.models import Transformer
from tessera.parallel.activation_checkpoint import apply_activation_checkpointing


class ForwardOpCounter(TorchDispatchMode):
    """Counts SDPA forwards and SiLU forwards (the MLP's gate) while active."""

    def __init__(self):
        super().__init__()
        self.sdpa = self.silu = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "scaled_dot_product" in name and "backward" not in name:
            self.sdpa += 1
        if name.startswith("aten.silu.") or name.startswith("aten.silu_."):
            self.silu += 1
        return func(*args, **(kwargs or {}))


def _grads_and_recompute_counts(mode: str, interval: int = 1):
    cfg = get_preset("tiny-moe")
    model = Transformer(cfg, init_seed=0)
    names_before = [n for n, _ in model.named_parameters()]
    wrapped = apply_activation_checkpointing(model, mode, interval)
    assert [n for n, _ in model.named_parameters()] == names_before
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    loss = out.logits.float().square().mean() + out.aux_loss
    counter = ForwardOpCounter()
    with counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, counter, wrapped


def test_recompute_modes_keep_gradients_and_rerun_forward():
    ref, none_count, wrapped = _grads_and_recompute_counts("none")
    assert wrapped == [] and none_count.sdpa == 0 and none_count.silu == 0
    for mode, interval, sdpa, silu_positive, expect in [
        ("full", 1, 2, True, ["layers.0", "layers.1"]),
        ("full", 2, 1, True, ["layers.0"]),
        ("selective", 1, 2, False, ["layers.0.attention", "layers.1.attention"]),
    ]:
        grads, count, wrapped = _grads_and_recompute_counts(mode, interval)
        assert wrapped == expect
        assert count.sdpa == sdpa, (mode, interval, count.sdpa)
        # selective keeps the MLP / experts' activations
        assert (count.silu > 0) == silu_positive, (mode, count.silu)
        for n, g in ref.items():
            assert torch.equal(grads[n], g), (mode, n)


def test_unknown_mode_is_refused():
    model = Transformer(get_preset("tiny-llama"), init_seed=0)
    with pytest.raises(ParallelError, match="recompute='some'"):
        apply_activation_checkpointing(model, "some")
