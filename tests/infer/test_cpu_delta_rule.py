"""The chunked delta rule's CPU kernel of a chunk's terms (`delta_chunk_terms`,
tessera/infer/cpu/csrc/delta_rule_cpu.cpp, at the mixers' `fused_chunk_terms` seam): its outputs equal
the terms computed with PyTorch ops; the chunked form through it equals the recurrent form (fp32 1e-5:
several chunk sizes, odd lengths, a start state, a decay per head and per key channel) and the PyTorch
chunked form; a decay too strong for it
within a chunk goes to the PyTorch ops; it is never used where a gradient is wanted; and the serving
engine's `fuse_layer_ops` installs it in Kimi Linear's and Qwen3-Next's mixers, whose logits then
still equal transformers'."""

from __future__ import annotations

import pytest
import torch

import tessera.models.linear_attention.delta_rule as rule
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.layer_ops import fuse_layer_ops, unfuse_layer_ops
from tessera.models.linear_attention.delta_rule import chunked_delta_rule, l2_factor, recurrent_delta_rule

B, S, H, K, V = 2, 37, 3, 8, 8


@pytest.fixture
def kernel(monkeypatch):
    """The kernel, which must build here (the project installs ninja; the machines have a compiler)."""
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"
    return torch.ops.tessera_cpu.delta_chunk_terms


def _inputs(per_channel: bool, seed: int = 0, strength: float = 0.5, value_dim: int = V):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, S, H, K, generator=gen), torch.randn(B, S, H, K, generator=gen)
    v = torch.randn(B, S, H, value_dim, generator=gen)
    g = -torch.rand(B, S, H, *((K,) if per_channel else ()), generator=gen) * strength
    beta = torch.rand(B, S, H, generator=gen)
    state = torch.randn(B, H, K, value_dim, generator=gen) * 0.3
    return q, k, v, g, beta, state


def _reference_terms(q, k, v, g, beta, C):
    """What the kernel computes (its header comment), with PyTorch ops, chunk by chunk."""
    N, per_channel = -(-S // C), g.dim() == 4
    pad = N * C - S

    def chunked(x):  # [B, S, H, ...] -> [N, B H, C, ...], zero-padded
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.view(B, N, C, H, *x.shape[3:]).movedim(3, 2).movedim(1, 0).reshape(N, B * H, C, *x.shape[3:])

    qn, kn = chunked(q * l2_factor(q, K ** -0.5)), chunked(k * l2_factor(k))
    c = chunked(g if per_channel else g[..., None].expand(B, S, H, K)).cumsum(dim=-2)
    b = chunked(beta)[..., None]
    qd, kb, kinv, vb = qn * c.exp(), b * kn * c.exp(), kn * (-c).exp(), b * chunked(v)
    eye = torch.eye(C).expand(N, B * H, C, C)
    T = torch.linalg.solve_triangular(eye + (kb @ kinv.transpose(-1, -2)).tril(-1), eye, upper=False)
    return (qd, T @ kb, T @ vb, (qd @ kinv.transpose(-1, -2)).tril(), kinv, c[..., -1:, :].exp().transpose(-1, -2),
            c.abs().max())


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("C", [1, 5, 16, 64])
def test_kernel_outputs_equal_the_terms_computed_with_pytorch(kernel, per_channel, C):
    q, k, v, g, beta, _ = _inputs(per_channel, value_dim=12)
    got = kernel(q, k, v, g, beta, C, K ** -0.5, rule.L2_EPS)
    want = _reference_terms(q, k, v, g, beta, C)
    names = ("qd", "W", "U", "scores", "kinv", "decay", "span")
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)  # exp(c) to |c| ~ 11 here


def test_kernel_reads_strided_views_as_their_copies(kernel):
    """q, k, v as views of one projection (the mixers' layout), beta and g transposed: the same outputs."""
    gen = torch.Generator().manual_seed(7)
    mixed = torch.randn(B, S, 3 * H * K, generator=gen)
    q, k, v = (t.view(B, S, H, K) for t in mixed.chunk(3, dim=-1))
    g = -torch.rand(B, H, K, S, generator=gen).permute(0, 3, 1, 2) * 0.3
    beta = torch.rand(B, H, S, generator=gen).transpose(1, 2)
    got = kernel(q, k, v, g, beta, 16, 0.3, 1e-6)
    want = kernel(*(t.contiguous() for t in (q, k, v, g, beta)), 16, 0.3, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 16, 32, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_through_the_kernel_equals_recurrent_and_the_pytorch_chunked_form(kernel, per_channel, chunk,
                                                                                  with_state):
    q, k, v, g, beta, state = _inputs(per_channel, seed=chunk)
    state = state if with_state else None
    want, want_state = recurrent_delta_rule(q, k, v, g, beta, state)
    torch_out, torch_state = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    calls = []
    counted = lambda *a: calls.append(1) or kernel(*a)  # noqa: E731
    got, got_state = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk, chunk_terms=counted)
    assert calls
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, torch_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, torch_state, atol=1e-5, rtol=1e-5)
    if with_state:  # the caller's start state is read, not written
        assert torch.equal(state, _inputs(per_channel, seed=chunk)[5])


def test_a_prompt_of_several_slabs_through_the_kernel_equals_recurrent(kernel, monkeypatch):
    """Slabs of one chunk each: the state passes from slab to slab as within one."""
    q, k, v, g, beta, state = _inputs(True, seed=3)
    want = recurrent_delta_rule(q, k, v, g, beta, state)
    monkeypatch.setattr(rule, "PER_CHANNEL_TERMS", 1)
    got = chunked_delta_rule(q, k, v, g, beta, state, chunk=8, chunk_terms=kernel)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_channel", [True, False])
def test_a_decay_too_strong_for_the_kernel_goes_to_the_pytorch_ops(kernel, monkeypatch, per_channel):
    """A channel decaying by more than SPAN_LIMIT within a chunk: that slab's terms come from the PyTorch
    ops (exp(-c) would overflow fp32), and the result still equals recurrent."""
    calls = []
    terms = rule._chunk_terms
    monkeypatch.setattr(rule, "_chunk_terms", lambda *a: calls.append(1) or terms(*a))
    q, k, v, g, beta, state = _inputs(per_channel, seed=5, strength=20.0)
    want = recurrent_delta_rule(q, k, v, g, beta, state)
    got = chunked_delta_rule(q, k, v, g, beta, state, chunk=32, chunk_terms=kernel)
    assert calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_kernel_is_not_used_where_a_gradient_is_wanted(kernel):
    q, k, v, g, beta, state = _inputs(True)
    q.requires_grad_(True)
    calls = []
    out, _ = chunked_delta_rule(q, k, v, g, beta, state, chunk=16, chunk_terms=lambda *a: calls.append(1))
    out.sum().backward()
    assert not calls and q.grad is not None and q.grad.abs().sum() > 0


def test_the_kernel_refuses_a_tensor_not_in_fp32(kernel):
    q, k, v, g, beta, _ = _inputs(True)
    with pytest.raises(RuntimeError, match="q must be an fp32 CPU tensor"):
        kernel(q.double(), k, v, g, beta, 8, 1.0, 1e-6)


@pytest.mark.parametrize("family, std", [("kimi_linear", 0.2), ("qwen3_next", None)])
def test_served_mixers_take_the_kernel_and_still_equal_transformers(kernel, family, std, tmp_path):
    """`fuse_layer_ops` (the serving engine's, for a model it owns) installs the kernel in every delta-rule
    mixer; a prompt of several chunks then gives transformers' logits, through the kernel (counted).
    The models are those of tests/models/test_kimi_linear.py and test_qwen3_next.py."""
    pytest.importorskip("transformers")
    from tessera.hf import load_pretrained
    from tests.models.hf_families import hf_configs, random_hf_model

    hf = random_hf_model(hf_configs()[family], seed=3, **({} if std is None else {"std": std}))
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.float32)
    fuse_layer_ops(model)
    mixers = [m for m in model.modules() if hasattr(m, "fused_chunk_terms")]
    assert mixers and all(m.fused_chunk_terms is kernel for m in mixers)
    calls = []
    for m in mixers:
        m.fused_chunk_terms = lambda *a: calls.append(1) or kernel(*a)
    ids = torch.randint(0, hf.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(calls) >= len(mixers)
    unfuse_layer_ops(model)
    assert all(m.fused_chunk_terms is None for m in mixers)


def test_the_bench_times_the_kernel_beside_both_forms(kernel):
    """bench/gated_deltanet.py --kernel (docs/benchmarks.md) on a small case: three sides timed, the
    kernel's outputs equal the recurrent form's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.hang_guard import HANG_S

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "bench" / "gated_deltanet.py"), "--tokens", "150", "--heads", "2",
                          "--head-dim", "8", "--chunk", "16", "--threads", "1", "--rounds", "1", "--per-channel",
                          "--kernel"], cwd=root, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert set(result["tokens_per_s"]) == {"chunked", "chunked_kernel", "recurrent"}
    assert result["max_abs_diff_kernel"] < 1e-5 and result["max_abs_diff"] < 1e-5
    assert len(result["per_round_kernel"]) == 1 and result["kernel_over_pytorch_chunked"] > 0
