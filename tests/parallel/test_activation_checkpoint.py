"""Activation recomputation and offload: gradients bit-identical to keeping everything, names
unchanged, and the chosen pieces really run again in backward (counted at the operator level)."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config import ConfigError, ParallelError, get_preset
from tessera.config.parallel import RECOMPUTE_SAVE_CHOICES, ParallelConfig
from tessera.models import Transformer
from tessera.parallel.memory.activation_checkpoint import apply_activation_checkpointing
from tessera.parallel.memory.activation_offload import HostStore, apply_activation_offload, offload_blocks
from tessera.parallel.memory.recompute_policy import ATTENTION_OPS, MATMUL_OPS


class ForwardOpCounter(TorchDispatchMode):
    """Counts SDPA, SiLU and matrix-product forwards (and backward matrix products) while active."""

    def __init__(self):
        super().__init__()
        self.sdpa = self.silu = self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if func in ATTENTION_OPS:
            self.sdpa += 1
        if name.startswith("aten.silu.") or name.startswith("aten.silu_."):
            self.silu += 1
        if func in MATMUL_OPS:
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


def _grads_and_recompute_counts(mode: str, interval: int = 1, preset: str = "tiny-moe", moe: dict | None = None,
                                **policy):
    cfg = get_preset(preset)
    if moe:
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))
    model = Transformer(cfg, init_seed=0)
    names_before = [n for n, _ in model.named_parameters()]
    wrapped = apply_activation_checkpointing(model, mode, interval, **policy)
    assert [n for n, _ in model.named_parameters()] == names_before
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    loss = out.logits.float().square().mean() + out.aux_loss
    counter = ForwardOpCounter()
    with counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, counter, wrapped


# tiny-moe: 2 MoE layers; per layer 8 matrix products in forward (wq, wk, wv, wo, router, the experts' w1,
# w3, w2 as grouped GEMMs) and 16 in backward (wq, wk, wv's input gradients under GQA ... counted below).
@pytest.mark.parametrize("mode, interval, policy, expect, sdpa, silu_reruns, extra_products", [
    ("full", 1, {}, ["layers.0", "layers.1"], 2, True, 16),
    ("full", 2, {}, ["layers.0"], 1, True, 8),
    ("selective", 1, {}, ["layers.0.attention.attention_core", "layers.1.attention.attention_core"], 2, False, 0),
    ("selective", 2, {}, ["layers.0.attention.attention_core"], 1, False, 0),
    # torchtitan's: the attention kernel and every other product kept; the other half re-runs
    ("op", 1, {}, ["layers.0", "layers.1"], 0, True, 8),
    ("op", 1, {"save": ("matmuls", "attention_core")}, ["layers.0", "layers.1"], 0, True, 0),
    ("op", 2, {"save": ("attention_core", "attention_in", "router", "mlp_in")}, ["layers.0"], 0, True, 2),
])
def test_policies_keep_gradients_and_rerun_what_they_do_not_keep(mode, interval, policy, expect, sdpa,
                                                                  silu_reruns, extra_products):
    ref, none_count, wrapped = _grads_and_recompute_counts("none")
    assert wrapped == [] and none_count.sdpa == 0 and none_count.silu == 0
    grads, count, wrapped = _grads_and_recompute_counts(mode, interval, **policy)
    assert wrapped == expect
    assert count.sdpa == sdpa, (mode, count.sdpa)  # the attention kernel re-runs only where not kept
    assert (count.silu > 0) == silu_reruns, (mode, count.silu)  # selective keeps the MLP's activations
    assert count.matmuls - none_count.matmuls == extra_products  # forward products re-run in backward
    for n, g in ref.items():
        assert torch.equal(grads[n], g), (mode, n)


def test_fp8_storage_keeps_products_in_fp8_and_changes_gradients_by_their_rounding():
    """activation_fp8: the kept SwiGLU gate/up outputs are stored in FP8 and the replay starts from
    them, so gradients move by about FP8's rounding (3 mantissa bits), not more; nothing is recomputed
    of them (their products do not re-run)."""
    ref, _, _ = _grads_and_recompute_counts("none")
    save = ("attention_core", "attention_in", "router", "mlp_in")
    grads, count, _ = _grads_and_recompute_counts("op", save=save, fp8=("mlp_in",))
    kept, kept_count, _ = _grads_and_recompute_counts("op", save=save)
    assert count.matmuls == kept_count.matmuls  # FP8 copies answer the replay: no product re-runs for them
    changed = 0
    for n, g in ref.items():  # E4M3 rounds each value by at most 2^-4 of itself
        assert (grads[n] - g).norm() <= 0.0625 * g.norm(), n
        changed += not torch.equal(grads[n], g)
    assert changed > 0  # lossy by design: the backward multiplies the rounded values


def test_offload_moves_saved_activations_to_host_and_back_bit_for_bit():
    """The offload hooks on CPU (host = CPU): the same gradients, and what the blocks saved went
    through the store (the trainer refuses the option on a CPU device, where it frees nothing)."""
    ref, _, _ = _grads_and_recompute_counts("none")
    cfg = get_preset("tiny-moe")
    model = Transformer(cfg, init_seed=0)
    store = HostStore()
    assert offload_blocks(model, store) == ["layers.0", "layers.1"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    (out.logits.float().square().mean() + out.aux_loss).backward()
    assert store.packed_bytes > 0 and store.unpacked  # saved tensors went to the host store and came back
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    with pytest.raises(ConfigError, match="activation_offload=true is invalid on cpu"):
        apply_activation_offload(Transformer(cfg, init_seed=0), "cpu")


def test_unknown_policies_and_names_are_refused():
    model = Transformer(get_preset("tiny-llama"), init_seed=0)
    with pytest.raises(ParallelError, match="recompute='some'"):
        apply_activation_checkpointing(model, "some")
    with pytest.raises(ConfigError, match="recompute_save holds 'qkv'"):
        ParallelConfig(recompute="op", recompute_save=["qkv"])
    with pytest.raises(ConfigError, match="activation_fp8 holds 'router'"):
        ParallelConfig(recompute="op", activation_fp8=["router"])  # the router is fp32 by design
    with pytest.raises(ConfigError, match="activation_fp8=.* needs parallel.recompute=op"):
        ParallelConfig(recompute="full", activation_fp8=["mlp_in"])
    assert ParallelConfig(recompute="op", recompute_save=["matmuls"]).recompute_save == ("matmuls",)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-deepseek"])
def test_every_save_choice_alone_and_every_interval_keeps_gradients_bit_identical(preset):
    """recompute=op with each entry of RECOMPUTE_SAVE_CHOICES on its own (MLA's up-projections, the
    router, the output and down products included), and every policy at interval 2 and 3: fp32 on
    the CPU, the gradients equal keeping everything bit for bit."""
    ref, _, _ = _grads_and_recompute_counts("none", preset=preset)
    cases = [("op", 1, {"save": (choice,)}) for choice in RECOMPUTE_SAVE_CHOICES]
    cases += [(mode, k, {}) for mode in ("full", "selective", "op") for k in (2, 3)]
    for mode, interval, policy in cases:
        grads, _, wrapped = _grads_and_recompute_counts(mode, interval, preset=preset, **policy)
        assert wrapped, (mode, interval, policy)
        for n, g in ref.items():
            assert torch.equal(grads[n], g), (preset, mode, interval, policy, n)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_relu2_experts_keep_gradients_under_every_save_list_that_names_them(grouped):
    """Nemotron-H's MoE variant (relu^2 routed experts, one grouped product per weight or one per expert, and a
    relu^2 shared expert) under recompute=op with save lists naming their up (mlp_in) and down (mlp_out)
    products, alone, together and with the rest: fp32, the gradients equal keeping everything bit for bit."""
    moe = {"grouped_gemm": grouped}
    ref, _, _ = _grads_and_recompute_counts("none", preset="tiny-nemotron-h-moe", moe=moe)
    for save in (("mlp_in",), ("mlp_out",), ("mlp_in", "mlp_out"), ("mlp_in", "router", "attention_in"),
                 ("alternate_matmuls",), ("matmuls", "attention_core")):
        grads, _, wrapped = _grads_and_recompute_counts("op", preset="tiny-nemotron-h-moe", moe=moe, save=save)
        assert len(wrapped) == 6
        for n, g in ref.items():
            assert torch.equal(grads[n], g), (save, n)
