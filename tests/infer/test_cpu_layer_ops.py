"""The one-pass CPU kernels of a served layer (tessera/infer/cpu/layer_ops.py) against the PyTorch
ops they replace, and a served model with them against the same model without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.infer import LLM, LLMEngine, SamplingParams
from tessera.infer.config import EngineConfig
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.layer_ops import fuse_layer_ops, unfuse_layer_ops
from tessera.models.mlp import FeedForward
from tessera.models.norm import RMSNorm
from tessera.models.rope import apply_rope, rope_cos_sin, rope_frequencies
from tests.infer.tiny_models import write_model


@pytest.fixture
def ops(monkeypatch):
    """The kernels, which must build here (the project installs ninja; the machines have a compiler)."""
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"
    return torch.ops.tessera_cpu


# widths: a multiple of 16, of 8 only, and neither (the loops' scalar tails); rows: one, a few, and
# enough to be split over threads
@pytest.mark.parametrize("D", [768, 24, 12])
@pytest.mark.parametrize("rows", [1, 5, 96])
def test_rms_norm_equals_the_module(ops, D, rows):
    gen = torch.Generator().manual_seed(D + rows)
    norm = RMSNorm(D, eps=1e-5)
    norm.weight.data = torch.randn(D, generator=gen)
    x = torch.randn(1, rows, D, generator=gen) * 3
    with torch.no_grad():
        want = norm(x)
    got = ops.rms_norm(x, norm.weight, norm.eps)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a strided input (a per-head view, as a QK norm gets) reads as its contiguous copy
    wide = torch.randn(rows, 3 * D, generator=gen)
    torch.testing.assert_close(ops.rms_norm(wide[:, D:2 * D], norm.weight, 1e-5),
                               ops.rms_norm(wide[:, D:2 * D].contiguous(), norm.weight, 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [64, 24, 12])
@pytest.mark.parametrize("B,S", [(1, 1), (1, 9), (2, 5), (1, 130)])
def test_rope_rotates_views_of_one_projection_in_place_as_apply_rope_does(ops, head_dim, B, S):
    H, G = 6, 2
    gen = torch.Generator().manual_seed(head_dim * S + B)
    qkv = torch.randn(B, S, (H + 2 * G) * head_dim, generator=gen)  # q, k, v: views of one fused product
    q, k, v = (t.view(B, S, -1, head_dim) for t in qkv.split([H * head_dim, G * head_dim, G * head_dim], dim=-1))
    positions = torch.arange(S)[None].expand(B, S) + torch.tensor([[3], [40]])[:B]
    inv_freq, factor = rope_frequencies(head_dim, 10000.0, None)
    cos, sin = rope_cos_sin(positions, inv_freq, factor, torch.float32)
    want_q, want_k, v_before = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.clone()
    ops.rope_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(v, v_before)  # the values beside them untouched
    if B == 1:
        return
    # cos / sin of one sequence broadcast over the batch
    q2, k2 = torch.randn(B, S, H, head_dim, generator=gen), torch.randn(B, S, G, head_dim, generator=gen)
    want_q, want_k = apply_rope(q2, cos[:1], sin[:1]), apply_rope(k2, cos[:1], sin[:1])
    ops.rope_(q2, k2, cos[:1], sin[:1])
    torch.testing.assert_close(q2, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k2, want_k, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("F_", [3072, 40, 13])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_silu_mul_equals_silu_times_up_over_strided_halves(ops, F_, rows):
    gen = torch.Generator().manual_seed(F_ + rows)
    gate_up = torch.randn(1, rows, 2 * F_, generator=gen) * 6
    gate_up[0, 0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])[:min(8, F_)]
    gate, up = gate_up.split(F_, dim=-1)
    got = ops.silu_mul(gate, up)
    assert got.shape == gate.shape and got.is_contiguous()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_the_kernels_refuse_what_they_cannot_compute(ops):
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="fp32 CPU tensor"):
        ops.rms_norm(x.bfloat16(), torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be \[16\]"):
        ops.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        ops.silu_mul(x.t(), x.t())
    with pytest.raises(RuntimeError, match="differ"):
        ops.silu_mul(x, torch.randn(3, 8))
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        ops.rope_(q, k, torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    with pytest.raises(RuntimeError, match="even head dim"):
        ops.rope_(torch.randn(1, 4, 2, 7), torch.randn(1, 4, 1, 7), torch.randn(1, 4, 7), torch.randn(1, 4, 7))


# qwen2: q/k/v biases; mistral: a sliding window; qwen3_moe: per-head QK norms, routed experts
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3_moe"])
def test_a_model_with_the_kernels_computes_the_same_logits_and_still_trains(ops, tmp_path, family):
    write_model(tmp_path, family)
    model = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, cpu_prepack=False)).executor.model
    ids = torch.tensor([[5, 9, 2, 7, 1, 3, 11, 4]])
    with torch.inference_mode():
        want = model(ids).logits
    n_norms = 2 * model.cfg.n_layers + 1 + (2 * model.cfg.n_layers if model.cfg.qk_norm else 0)
    n_mlps = sum(isinstance(m, FeedForward) for m in model.modules())  # dense layers, shared experts
    assert fuse_layer_ops(model) == n_norms + model.cfg.n_layers + n_mlps  # + each layer's rotary
    layer = model.layers["0"]
    assert layer.attention_norm.fused is ops.rms_norm and layer.attention.fused_rope is ops.rope_
    assert model.cfg.qk_norm == (layer.attention.q_norm is not None and layer.attention.q_norm.fused is ops.rms_norm)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    # with autograd on, the seams step aside: the same loss and gradients as the plain modules
    model.train()
    loss = model(ids).logits.float().square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    unfuse_layer_ops(model)
    plain = model(ids).logits.float().square().mean()
    plain.backward()
    assert torch.equal(loss, plain) and grads
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0)


def test_the_engine_installs_the_kernels_on_cpu_unless_switched_off(ops, tmp_path, monkeypatch):
    write_model(tmp_path, "llama")
    config = dict(block_size=4, max_num_seqs=8, enable_prefix_caching=False)
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6][:n] for n in (1, 3, 9, 6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_kernels = LLM(str(tmp_path), EngineConfig(**config))
    model = with_kernels.engine.executor.model
    assert model.norm.fused is ops.rms_norm and model.layers["1"].feed_forward.fused_act is ops.silu_mul
    mlp = model.layers["1"].feed_forward  # hidden size 48: three panel pairs, the activation in the product
    assert mlp.fused_swiglu is not None and mlp.fused_swiglu == mlp.fused_gate_up.swiglu
    monkeypatch.setenv(cpu_attention.ENV, "torch")
    without = LLM(str(tmp_path), EngineConfig(**config))
    plain = without.engine.executor.model
    assert plain.norm.fused is None and plain.layers["0"].attention.fused_rope is None
    assert plain.layers["1"].feed_forward.fused_act is None and plain.layers["1"].feed_forward.fused_swiglu is None
    got = [o.token_ids for o in with_kernels.generate(prompts, params)]
    assert got == [o.token_ids for o in without.generate(prompts, params)] and all(len(t) == 12 for t in got)
