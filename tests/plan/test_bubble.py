"""Pipeline bubble and in-flight micro-batches: Megatron's formulas (Narayanan et al. 2021,
section 2.2), the zero-bubble schedules (Qi et al. 2023), and a simulation of the schedules."""

from __future__ import annotations

import pytest

from tessera.config.errors import ConfigError
from tessera.plan.activations import in_flight_microbatches
from tessera.plan.bubble import bubble_fraction, bubble_table
from tests.plan.pipeline_simulator import simulate


def test_megatron_bubble_fractions():
    """GPipe and 1F1B: (p - 1)/m; interleaved with v chunks: (p - 1)/(v m). For example p = 8
    stages and m = 64 micro-batches idle 10.9% of the ideal time, 5.5% with v = 2."""
    assert bubble_fraction("1f1b", 8, 64) == pytest.approx(7 / 64)
    assert bubble_fraction("gpipe", 8, 64) == bubble_fraction("1f1b", 8, 64)
    assert bubble_fraction("interleaved_1f1b", 8, 64, 2) == pytest.approx(7 / 128)
    assert bubble_fraction("1f1b", 1, 64) == 0
    assert round(100 * bubble_fraction("1f1b", 8, 64), 1) == 10.9


def test_zero_bubble_schedules():
    """ZB-H1 leaves (p-1)(T_F + T_B - T_W) idle against 1F1B's (p-1)(T_F + T_B + T_W): a third of
    it when the three passes cost the same; ZB-H2 and ZB-V reach zero in that setting."""
    p, m = 4, 16
    assert bubble_fraction("zero_bubble", p, m) == pytest.approx(bubble_fraction("1f1b", p, m) / 3)
    assert bubble_fraction("zero_bubble", p, m, t_f=1, t_b=1, t_w=0) == pytest.approx((p - 1) * 2 / (m * 2))
    table = bubble_table(p, m)
    assert table["zb_h2"] == table["zb_v"] == 0
    assert table["1f1b"] > table["interleaved_1f1b(v=2)"] > table["zero_bubble(ZB-H1)"] > 0


def test_unknown_schedule_is_refused():
    with pytest.raises(ConfigError, match="one of gpipe"):
        bubble_fraction("chimera", 4, 8)


def test_dualpipe_bubble_is_deepseeks_formula():
    """(p/2 - 1)(T_F&B + T_B - 3 T_W) idle (DeepSeek-V3, table 2), T_F&B = T_F + T_B without overlap."""
    assert bubble_fraction("dualpipe", 8, 16) == 0.0  # equal passes
    p, m, f, b, w = 8, 16, 1.0, 2.0, 0.5
    assert bubble_fraction("dualpipe", p, m, t_f=f, t_b=b, t_w=w) == pytest.approx(
        (p / 2 - 1) * (f + b + b - 3 * w) / (m * (f + b + w)))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_bubble_matches_formula(schedule, p, m):
    sim = simulate(schedule, p, m)
    assert sim.bubble_fraction == pytest.approx(bubble_fraction(schedule, p, m))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2)])
def test_simulated_interleaved_bubble_matches_formula(p, m, v):
    sim = simulate("interleaved_1f1b", p, m, v)
    assert sim.bubble_fraction == pytest.approx(bubble_fraction("interleaved_1f1b", p, m, v))


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 4, 1),
                                            ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 16, 4)])
def test_in_flight_micro_batches_match_the_simulated_schedule(schedule, p, m, v):
    """What the activation estimator multiplies a stage's per-micro-batch bytes by, per rank:
    GPipe m; 1F1B min(p - r, m); interleaved ((v-1) p + 2 (p-r-1) + 1) chunks / v, which is
    p (1 + (p-1)/(p v)) stages' worth on the first rank (Korthikanti et al. 2022, section 4.2.3)."""
    sim = simulate(schedule, p, m, v)
    for r in range(p):
        assert in_flight_microbatches(schedule, p, m, v, r) == pytest.approx(sim.peak_in_flight[r]), r
    if schedule == "interleaved_1f1b":
        assert sim.peak_in_flight[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))
