"""Mamba-2 (tessera/models/linear_attention/ssd.py, mamba2.py): the chunked form of SSD equals the
recurrent one for several chunk sizes (fp32 1e-5), both equal transformers' Nemotron-H scan functions,
and the mixer equals transformers' NemotronHMamba2Mixer on a prompt and token by token, and fed a
sequence in pieces (its state carried from call to call) equals it fed whole."""

import pytest
import torch

from tessera.config.model import ModelConfig
from tessera.models.linear_attention.mamba2 import Mamba2Mixer
from tessera.models.linear_attention.ssd import chunked_ssd, recurrent_ssd, step_sizes

B, S, H, P, G, N = 2, 37, 6, 5, 3, 4


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, P, generator=gen)
    dt = torch.rand(B, S, H, generator=gen) * 0.5 + 0.01
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    Bm, Cm = torch.randn(B, S, G, N, generator=gen), torch.randn(B, S, G, N, generator=gen)
    D = torch.randn(H, generator=gen)
    state = torch.randn(B, H, P, N, generator=gen) * 0.3
    return x, dt, A, Bm, Cm, D, state


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(chunk, with_state):
    x, dt, A, Bm, Cm, D, state = _inputs()
    state = state if with_state else None
    want, want_state = recurrent_ssd(x, dt, A, Bm, Cm, D, state)
    got, got_state = chunked_ssd(x, dt, A, Bm, Cm, D, state, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


def test_chunked_a_chunk_per_slab_equals_recurrent(monkeypatch):
    """With every slab a single chunk (SLAB_TERMS = 1) the chunked form still equals the recurrent one:
    the state passes from slab to slab as from chunk to chunk."""
    import tessera.models.linear_attention.ssd as ssd
    x, dt, A, Bm, Cm, D, state = _inputs(3)
    want, want_state = recurrent_ssd(x, dt, A, Bm, Cm, D, state)
    monkeypatch.setattr(ssd, "SLAB_TERMS", 1)
    got, got_state = chunked_ssd(x, dt, A, Bm, Cm, D, state, chunk=8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rate, shared", [(1.0, True), (60.0, False)])
def test_each_way_of_the_chunk_decays_equals_recurrent(monkeypatch, rate, shared):
    """A mild decay takes the slab whose L x L matrix its group's heads share (the decays on x's and
    the output's rows); one that decays a head by more than SPAN_LIMIT within a chunk takes the
    per-head decay matrices; either way chunked equals recurrent."""
    import tessera.models.linear_attention.ssd as ssd
    calls = []
    per_head = ssd._ssd_slab
    monkeypatch.setattr(ssd, "_ssd_slab", lambda *a: calls.append(1) or per_head(*a))
    x, dt, _, Bm, Cm, D, state = _inputs(6)
    A = -torch.full((H,), rate)
    want, want_state = recurrent_ssd(x, dt, A, Bm, Cm, D, state)
    got, got_state = chunked_ssd(x, dt, A, Bm, Cm, D, state, chunk=16)
    assert bool(calls) != shared
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


def test_chunked_gradients_equal_recurrent():
    """Training runs the chunked form: its gradients (inputs, rates, B, C, D and the start state)
    equal the recurrent form's."""
    inputs = _inputs(4)
    grads = []
    for scan, kwargs in ((recurrent_ssd, {}), (chunked_ssd, {"chunk": 8})):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y, final = scan(*leaves, **kwargs)
        (y.square().sum() + final.square().sum()).backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_both_forms_equal_transformers():
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, _, A, Bm, Cm, D, state = _inputs(1)
    gen = torch.Generator().manual_seed(5)
    raw, bias = torch.randn(B, S, H, generator=gen), torch.randn(H, generator=gen)
    want, want_state = hf.mamba2_chunk_scan(x, raw, A, Bm, Cm, chunk_size=8, D=D, dt_bias=bias,
                                            initial_states=state, dt_softplus=True, return_final_states=True)
    dt = step_sizes(raw, bias, 0.0)
    for out, out_state in (recurrent_ssd(x, dt, A, Bm, Cm, D, state), chunked_ssd(x, dt, A, Bm, Cm, D, state, 16)):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_state, want_state, atol=1e-5, rtol=1e-5)
    # one decode step against transformers' state update
    hf_state = state.clone()
    step = hf.mamba2_selective_state_update(
        hf_state, x[:, 0], raw[:, 0, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), Bm[:, 0],
        Cm[:, 0], D[:, None].expand(-1, P), dt_bias=bias[:, None].expand(-1, P), dt_softplus=True)
    ours, ours_state = recurrent_ssd(x[:, :1], dt[:, :1], A, Bm[:, :1], Cm[:, :1], D, state)
    torch.testing.assert_close(ours[:, 0], step, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, hf_state, atol=1e-5, rtol=1e-5)


def test_padding_steps_write_nothing():
    """A length that is no multiple of the chunk pads with dt = 0 steps: the final state is the one
    after the real tokens (a chunk size that divides the length gives the same)."""
    x, dt, A, Bm, Cm, D, state = _inputs(2)
    _, padded = chunked_ssd(x, dt, A, Bm, Cm, D, state, chunk=10)  # 37 = 3 x 10 + 7
    _, exact = chunked_ssd(x, dt, A, Bm, Cm, D, state, chunk=37)
    torch.testing.assert_close(padded, exact, atol=1e-5, rtol=1e-5)


def _cfg(chunk: int = 8) -> ModelConfig:
    mamba = dict(n_heads=6, head_dim=4, state_size=5, n_groups=3, conv_width=4, chunk_size=chunk, dt_min=0.0)
    return ModelConfig(family="nemotron_h", vocab_size=64, dim=24, n_layers=1, n_heads=2, ffn_dim=32, norm_eps=1e-5,
                       activation="relu2", sublayers=["mamba"], mamba=mamba)


def _mixer_pair():
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    from transformers import NemotronHConfig
    cfg = _cfg()
    hf_cfg = NemotronHConfig(hidden_size=24, mamba_num_heads=6, mamba_head_dim=4, ssm_state_size=5, n_groups=3,
                             conv_kernel=4, chunk_size=8, layers_block_type=["linear_attention"], time_step_min=0.0,
                             layer_norm_epsilon=1e-5, vocab_size=64)
    theirs = hf.NemotronHMamba2Mixer(hf_cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        theirs.A_log.copy_(torch.rand(6, generator=gen))
    ours = Mamba2Mixer(cfg, 0)
    ours.load_state_dict(theirs.state_dict())
    return hf, hf_cfg, theirs, ours


def test_mixer_equals_transformers_on_a_prompt_and_decoding():
    hf, hf_cfg, theirs, ours = _mixer_pair()
    from transformers import DynamicCache
    x = torch.randn(2, 19, 24, generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=hf_cfg)
    with torch.no_grad():
        want = torch.cat([theirs(x[:, :15], cache_params=cache)] + [
            theirs(x[:, t:t + 1], cache_params=cache) for t in range(15, 19)], dim=1)
        got, state = ours.mix(x[:, :15])
        steps = []
        for t in range(15, 19):
            y, state = ours.mix(x[:, t:t + 1], state)
            steps.append(y)
        got = torch.cat([got, *steps], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert state.tokens == 19 and state.ssm.shape == (2, 6, 4, 5) and state.conv.shape == (2, 6 * 4 + 2 * 3 * 5, 3)


def test_mixer_in_pieces_equals_whole_in_either_form():
    torch.manual_seed(0)
    ours = Mamba2Mixer(_cfg(chunk=4), 0)
    with torch.no_grad():
        ours.A_log.uniform_(0.0, 1.0)
        ours.dt_bias.uniform_(-1.0, 1.0)
    x = torch.randn(1, 23, 24)
    with torch.no_grad():
        whole, whole_state = ours.mix(x)
        first, state = ours.mix(x[:, :9])
        rest, state = ours.mix(x[:, 9:], state, recurrent=True)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.ssm, whole_state.ssm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.conv, whole_state.conv)


def test_the_benchmark_times_two_forms_that_agree(capsys):
    """bench/mamba2_ssd.py on a small case: what it times in each form computes the same outputs."""
    import json

    from bench.mamba2_ssd import main

    assert main(["--tokens", "40", "--heads", "4", "--head-dim", "3", "--groups", "2", "--state", "5",
                 "--chunk", "16", "--rounds", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_abs_diff"] < 1e-4 and set(report["tokens_per_s"]) == {"chunked", "recurrent"}
