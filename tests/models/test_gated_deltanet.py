"""Gated DeltaNet (tessera/models/linear_attention): the chunked form of the gated delta rule equals
the recurrent one for several chunk sizes (fp32 1e-5), both equal transformers' Qwen3-Next
functions, and the layer fed a sequence in pieces (its recurrent state carried from call to call,
through `mix` or through an inference cache) equals the layer fed it whole."""

import pytest
import torch

from tessera.config.model import ModelConfig
from tessera.models.linear_attention.delta_rule import causal_conv, chunked_delta_rule, recurrent_delta_rule
from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet
from tessera.models.transformer import init_by_name

B, S, H, K, V = 2, 37, 3, 8, 6


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, S, H, K, generator=gen), torch.randn(B, S, H, K, generator=gen)
    v = torch.randn(B, S, H, V, generator=gen)
    g = -torch.rand(B, S, H, generator=gen) * 0.5  # log-decay <= 0
    beta = torch.rand(B, S, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(chunk, with_state):
    q, k, v, g, beta, state = _inputs()
    state = state if with_state else None
    want, want_state = recurrent_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


def test_both_forms_equal_transformers():
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, state = _inputs(1)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want, want_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
    hf_chunked, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
    torch.testing.assert_close(hf_chunked, want, atol=1e-5, rtol=1e-5)
    for out, out_state in (recurrent_delta_rule(q, k, v, g, beta, state), chunked_delta_rule(q, k, v, g, beta, state)):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_state, want_state, atol=1e-5, rtol=1e-5)


def test_causal_conv_in_pieces_equals_whole():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 5, 9, generator=gen), torch.randn(5, 4, generator=gen)
    whole, whole_state = causal_conv(x, w, None)
    first, state = causal_conv(x[..., :4], w, None)
    rest, state = causal_conv(x[..., 4:], w, state)
    torch.testing.assert_close(torch.cat([first, rest], dim=-1), whole)
    torch.testing.assert_close(state, whole_state)
    # causal: the output at t reads only inputs up to t
    changed = x.clone()
    changed[..., 6:] += 1.0
    torch.testing.assert_close(causal_conv(changed, w, None)[0][..., :6], whole[..., :6])


def _layer(chunk: int = 8) -> GatedDeltaNet:
    cfg = ModelConfig(family="llama", vocab_size=32, dim=24, n_layers=1, n_heads=4, ffn_dim=32,
                      linear_attention=dict(layers=[0], n_key_heads=2, n_value_heads=4, key_head_dim=8,
                                            value_head_dim=6, conv_width=4, chunk_size=chunk))
    layer = GatedDeltaNet(cfg, 0)
    init_by_name(layer.named_parameters(), {"norm.weight"}, 3, 0.2)
    return layer


def test_layer_in_pieces_equals_whole_and_recurrent_equals_chunked():
    layer = _layer()
    x = torch.randn(2, 30, 24, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole, whole_state = layer.mix(x)
        token_by_token, _ = layer.mix(x, recurrent=True)
        torch.testing.assert_close(token_by_token, whole, atol=1e-5, rtol=1e-5)
        state, pieces = None, []
        for lo, hi in ((0, 11), (11, 12), (12, 29), (29, 30)):  # a prompt chunk, a token, a chunk, a token
            y, state = layer.mix(x[:, lo:hi], state)
            pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.delta, whole_state.delta, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.conv, whole_state.conv)


def test_layer_keeps_its_state_in_an_inference_cache():
    from tessera.infer.engine.reference_generation import ConcatKVCache

    layer = _layer()
    x = torch.randn(1, 12, 24, generator=torch.Generator().manual_seed(5))
    cache = ConcatKVCache()
    with torch.no_grad():
        whole = layer(x)
        first, second = layer(x[:, :9], cache=cache), layer(x[:, 9:], cache=cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-5, rtol=1e-5)
    assert cache.recurrent_state(0) is not None and cache.length() == 12


def test_gradients_flow_through_the_chunked_form():
    layer = _layer(chunk=4)
    x = torch.randn(1, 10, 24, requires_grad=True)
    layer.mix(x)[0].square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    assert x.grad.abs().sum() > 0


def test_chunked_a_chunk_per_slab_equals_recurrent(monkeypatch):
    """With the per-head terms computed one chunk at a time (PER_HEAD_TERMS = 1) the chunked form
    still equals the recurrent one."""
    import tessera.models.linear_attention.delta_rule as rule
    q, k, v, g, beta, state = _inputs(4)
    want = recurrent_delta_rule(q, k, v, g, beta, state)
    monkeypatch.setattr(rule, "PER_HEAD_TERMS", 1)
    for got, expected in zip(chunked_delta_rule(q, k, v, g, beta, state, chunk=8), want):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_chunked_gradients_equal_recurrent(per_channel):
    """Training runs the chunked form: its gradients (through the batched triangular solve, the
    decays and the start state) equal the recurrent form's, for both decays."""
    q, k, v, g, beta, state = _inputs(5)
    if per_channel:
        g = -torch.rand(B, S, H, K, generator=torch.Generator().manual_seed(6)) * 0.5
    grads = []
    for rule, kwargs in ((recurrent_delta_rule, {}), (chunked_delta_rule, {"chunk": 16})):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
        out, out_state = rule(*leaves, **kwargs)
        (out.square().sum() + out_state.square().sum()).backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("decay", [[], ["--per-channel"]], ids=["per-head", "per-channel"])
def test_the_bench_times_two_forms_with_equal_outputs(decay):
    """bench/gated_deltanet.py (docs/benchmarks.md) on a small case: both forms timed, outputs equal
    (also with Kimi delta attention's per-channel decay)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.hang_guard import HANG_S

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "bench" / "gated_deltanet.py"), "--tokens", "150", "--heads", "2",
                          "--head-dim", "8", "--chunk", "16", "--threads", "1", "--rounds", "1", *decay], cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["max_abs_diff"] < 1e-5 and min(result["tokens_per_s"].values()) > 0
    assert result["decay"] == ("per channel" if decay else "per head")


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_chunked_without_gradients_leaves_the_start_state_as_it_was(per_channel):
    """Without gradients the chunked form updates its state in place (no copy of it per chunk): the
    caller's fp32 start state is left as it was, and the result equals the one computed for gradients."""
    q, k, v, g, beta, state = _inputs(6)
    if per_channel:
        g = -torch.rand(B, S, H, K, generator=torch.Generator().manual_seed(7)) * 0.5
    before = state.clone()
    with torch.no_grad():
        got = chunked_delta_rule(q, k, v, g, beta, state, chunk=8)
    assert torch.equal(state, before)
    want = chunked_delta_rule(*(t.clone().requires_grad_() for t in (q, k, v, g, beta, state)), chunk=8)
    for a, b in zip(got, want):
        assert b.requires_grad
        torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_a_chunk_of_whole_tiles_is_computed_a_tile_at_a_time(monkeypatch, per_channel):
    """A chunk of a whole number of TILEs (64 = 2 x 32) is computed a tile at a time, and equals the
    chunk computed whole (TILE out of the way) and the recurrent form."""
    import tessera.models.linear_attention.delta_rule as rule
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 70, 2, 8, generator=gen) for _ in range(3))
    g = -torch.rand(1, 70, 2, *((8,) if per_channel else ()), generator=gen) * 0.5
    beta, state = torch.rand(1, 70, 2, generator=gen), torch.randn(1, 2, 8, 8, generator=gen) * 0.3
    steps = []
    chunk_step = rule._chunk_step
    monkeypatch.setattr(rule, "_chunk_step", lambda *a: steps.append(1) or chunk_step(*a))
    want = recurrent_delta_rule(q, k, v, g, beta, state)
    tiled = chunked_delta_rule(q, k, v, g, beta, state, chunk=64)
    assert len(steps) == 3  # 70 tokens in tiles of 32
    monkeypatch.setattr(rule, "TILE", 1024)
    whole = chunked_delta_rule(q, k, v, g, beta, state, chunk=64)
    assert len(steps) == 3 + 2
    for a, b, c in zip(tiled, whole, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_the_delta_rule_computes_in_fp32_under_autocast():
    """`train.dtype: bf16` runs the model under autocast: Qwen3-Next's forward and backward run (the state
    update met a bf16 correction and fp32 keys: a dtype error), and the delta rule's outputs and gradients
    are its fp32 ones, whatever the caller's autocast."""
    from tessera.config import get_preset
    from tessera.models import Transformer

    model = Transformer(get_preset("tiny-qwen3-next"), init_seed=0)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert torch.isfinite(loss)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 48, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    g, beta = -torch.rand(1, 48, 2, generator=gen), torch.rand(1, 48, 2, generator=gen)
    plain = chunked_delta_rule(q, k, v, g, beta, chunk=16)[0]
    want = torch.autograd.grad(plain.sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = chunked_delta_rule(q, k, v, g, beta, chunk=16)[0]
    assert under.dtype == torch.float32 and torch.equal(under, plain)
    for got, w in zip(torch.autograd.grad(under.sum(), (q, k, v)), want, strict=True):
        assert torch.equal(got, w)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_operator_level_recomputation_trains_a_delta_rule_model_as_without_it(name):
    """`parallel.recompute: op` keeps the products its save list names and re-runs the rest in backward;
    the chunk step added to bmm's output in place, which the policy had kept ("Tensor cached during
    selective activation checkpoint has been mutated"). The gradients equal those without recomputation."""
    from tessera.config import get_preset
    from tessera.models import Transformer
    from tessera.parallel.memory.activation_checkpoint import apply_activation_checkpointing

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in ("none", "op"):
        model = Transformer(get_preset(name), init_seed=0)
        apply_activation_checkpointing(model, recompute, 1)
        model(ids).logits.logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-6, msg=n)
