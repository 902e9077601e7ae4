"""The recurrences' start state handed on (tessera/models/linear_attention/handoff.py): a part run from a
zero start, then corrected by the start state the handoff gives once it has the part's (transition,
zero-start end state), equals the recurrent form run from that start state (outputs and end state,
fp32 1e-5) for the gated delta rule with a decay per head (Gated DeltaNet) and per key channel (Kimi
delta attention) and for SSD (Mamba-2), at several chunk sizes; and the (transition, end) it hands over
map that start state to the part's true end state; a part shorter than the convolution's window is
refused by name."""

import pytest
import torch

from tessera.models.linear_attention.delta_rule import recurrent_delta_rule
from tessera.models.linear_attention.handoff import handed_on_delta_rule, handed_on_ssd
from tessera.models.linear_attention.ssd import recurrent_ssd

B, S, H, K, V = 2, 13, 3, 8, 6
P, G, N = 5, 3, 4


class GivenStart:
    """A handoff whose earlier parts ended in `start`; keeps what the part handed over."""

    def __init__(self, start: torch.Tensor):
        self.start, self.handed = start, None

    def start_states(self, transition, end, apply):
        self.handed = (transition, end, apply)
        return self.start


def _check_handed(handoff: GivenStart, want_state: torch.Tensor) -> None:
    transition, end, apply = handoff.handed
    torch.testing.assert_close(apply(transition, handoff.start) + end, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 16])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head-decay", "per-channel-decay"])
def test_delta_rule_from_a_handed_on_state_equals_running_from_it(chunk, per_channel):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, S, H, K, generator=gen), torch.randn(B, S, H, K, generator=gen)
    v = torch.randn(B, S, H, V, generator=gen)
    g = -torch.rand(*((B, S, H, K) if per_channel else (B, S, H)), generator=gen) * 0.5
    beta = torch.rand(B, S, H, generator=gen)
    handoff = GivenStart(torch.randn(B, H, K, V, generator=gen))
    want, want_state = recurrent_delta_rule(q, k, v, g, beta, handoff.start)
    got, got_state = handed_on_delta_rule(q, k, v, g, beta, chunk, handoff)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
    _check_handed(handoff, want_state)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_ssd_from_a_handed_on_state_equals_running_from_it(chunk):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, P, generator=gen)
    dt = torch.rand(B, S, H, generator=gen) * 0.5 + 0.01
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    Bm, Cm = torch.randn(B, S, G, N, generator=gen), torch.randn(B, S, G, N, generator=gen)
    D = torch.randn(H, generator=gen)
    handoff = GivenStart(torch.randn(B, H, P, N, generator=gen))
    want, want_state = recurrent_ssd(x, dt, A, Bm, Cm, D, handoff.start)
    got, got_state = handed_on_ssd(x, dt, A, Bm, Cm, D, chunk, handoff)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
    _check_handed(handoff, want_state)


def test_a_part_shorter_than_the_convolution_window_is_refused_by_name():
    """The previous part's last W-1 convolution inputs are all a part reads of it: a part of fewer
    tokens would need the part before that too; refused naming train.seq_len and cp."""
    from tessera.config.errors import ParallelError
    from tessera.models.linear_attention.gated_deltanet import conv_start

    message = ("a context-parallel part of 2 tokens is shorter than the short convolution's 3 earlier inputs; "
               "choose a longer train.seq_len or fewer cp")
    with pytest.raises(ParallelError, match=message):
        conv_start(GivenStart(None), torch.zeros(1, 2, 6), torch.zeros(6, 4), None)
