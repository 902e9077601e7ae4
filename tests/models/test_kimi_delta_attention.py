"""Kimi delta attention (tessera/models/linear_attention/kimi_delta_attention.py): the gated delta
rule with a decay per key channel, chunked equal to recurrent for several chunk sizes (fp32 1e-5),
both equal to transformers' Kimi Linear functions (also with a strong decay), and the layer fed a
sequence in pieces (its state carried from call to call) equal to the layer fed it whole, token by
token equal to chunked, and equal to transformers' KimiLinearDeltaAttention."""

import pytest
import torch

from tessera.config.model import ModelConfig
from tessera.models.linear_attention.delta_rule import chunked_delta_rule, recurrent_delta_rule
from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
from tessera.models.transformer import init_by_name

B, S, H, K, V = 2, 37, 3, 8, 8


def _inputs(seed: int = 0, strength: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, S, H, K, generator=gen), torch.randn(B, S, H, K, generator=gen)
    v = torch.randn(B, S, H, V, generator=gen)
    g = -torch.rand(B, S, H, K, generator=gen) * strength  # a log-decay <= 0 per key channel
    beta = torch.rand(B, S, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_per_channel_chunked_equals_recurrent(chunk, with_state):
    q, k, v, g, beta, state = _inputs()
    state = state if with_state else None
    want, want_state = recurrent_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strength, way", [(0.5, "whole chunk"), (4.0, "row blocks"), (20.0, "exact")])
def test_each_way_of_the_decayed_products_equals_recurrent(monkeypatch, strength, way):
    """A mild decay takes one product per chunk referred to its first row; one that decays a channel
    by more than SPAN_LIMIT within the chunk (of 32) but not within a row block (of 16) takes the
    products referred to each row block's first row; one that does within a row block takes the exact
    sub-block products; each way chunked equals recurrent."""
    import tessera.models.linear_attention.delta_rule as rule
    calls = []

    def counted(name):
        products = getattr(rule, name)
        return lambda *a: calls.append(name) or products(*a)
    for name in ("_referenced_products", "_exact_products"):
        monkeypatch.setattr(rule, name, counted(name))
    q, k, v, g, beta, state = _inputs(5, strength)
    want, want_state = recurrent_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunked_delta_rule(q, k, v, g, beta, state, chunk=32)
    expected = {"whole chunk": set(), "row blocks": {"_referenced_products"}, "exact": {"_exact_products"}}[way]
    assert set(calls) == expected
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


def test_per_channel_decay_differs_from_its_head_mean():
    """The channels' own decays matter: averaging them per head changes the output."""
    q, k, v, g, beta, state = _inputs(3)
    per_channel, _ = recurrent_delta_rule(q, k, v, g, beta, state)
    per_head, _ = recurrent_delta_rule(q, k, v, g.mean(-1), beta, state)
    assert (per_channel - per_head).abs().max() > 1e-2


def test_chunk_terms_bounded_a_few_chunks_at_a_time(monkeypatch):
    """With the per-channel term computed one chunk at a time the result is the same."""
    import tessera.models.linear_attention.delta_rule as rule
    q, k, v, g, beta, state = _inputs(4)
    want = chunked_delta_rule(q, k, v, g, beta, state, chunk=8)
    monkeypatch.setattr(rule, "PER_CHANNEL_TERMS", 1)
    got = chunked_delta_rule(q, k, v, g, beta, state, chunk=8)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("strength", [0.5, 20.0])
def test_both_forms_equal_transformers(strength):
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, state = _inputs(1, strength)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want, want_state = hf.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, **kwargs)
    for out, out_state in (recurrent_delta_rule(q, k, v, g, beta, state),
                           chunked_delta_rule(q, k, v, g, beta, state, chunk=16)):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_state, want_state, atol=1e-5, rtol=1e-5)


def _cfg(chunk: int = 8) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=32, dim=24, n_layers=1, n_heads=4, ffn_dim=32,
                       linear_attention=dict(layers=[0], n_key_heads=3, n_value_heads=3, key_head_dim=6,
                                             value_head_dim=6, conv_width=3, chunk_size=chunk, kind="kda"))


def _layer(chunk: int = 8) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(_cfg(chunk), 0)
    init_by_name(layer.named_parameters(), {"o_norm.weight"}, 3, 0.3)
    return layer


def test_layer_in_pieces_equals_whole_and_recurrent_equals_chunked():
    layer = _layer()
    x = torch.randn(2, 30, 24, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole, whole_state = layer.mix(x)
        token_by_token, _ = layer.mix(x, recurrent=True)
        torch.testing.assert_close(token_by_token, whole, atol=1e-5, rtol=1e-5)
        state, pieces = None, []
        for a, b in ((0, 7), (7, 8), (8, 21), (21, 30)):
            y, state = layer.mix(x[:, a:b], state)
            pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.delta, whole_state.delta, atol=1e-5, rtol=1e-5)
    assert state.tokens == whole_state.tokens == 30


def test_layer_equals_transformers():
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig
    config = KimiLinearConfig(hidden_size=24, linear_num_heads=3, linear_head_dim=6, linear_conv_kernel_dim=3,
                              num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-5)
    theirs = hf.KimiLinearDeltaAttention(config, 0).eval()
    ours = KimiDeltaAttention(ModelConfig(**{**_cfg().to_dict(), "norm_eps": 1e-5}), 0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        mine = dict(ours.named_parameters())
        for name, p in theirs.named_parameters():
            if name == "conv1d.weight":  # theirs joined at load; Kimi's files keep q, k and v apart, as we do
                for part, taps in zip("qkv", p.chunk(3)):
                    mine[f"{part}_conv1d.weight"].copy_(taps)
            else:
                mine[name.removeprefix("forget_gate.")].copy_(p)
        x = torch.randn(2, 19, 24, generator=gen)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
