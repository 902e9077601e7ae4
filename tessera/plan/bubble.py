"""Pipeline bubble: the share of a step that pipeline ranks sit idle, relative to the ideal time.

With p stages and m micro-batches per step (Narayanan et al. 2021, arXiv 2104.04473, section 2.2):
- GPipe and 1F1B: (p - 1) / m. 1F1B only lowers memory (p micro-batches in flight, not m).
- Interleaved 1F1B with v model chunks per rank: (p - 1) / (v m), for v times the
  point-to-point traffic.
- Zero-bubble schedules (Qi et al. 2023, arXiv 2401.10241) split the backward into B (input
  gradient) and W (weight gradient) and fill the bubble with W. ZB-H1 keeps 1F1B's peak memory
  and leaves (p - 1)(T_F + T_B - T_W) of idle time against 1F1B's (p - 1)(T_F + T_B + T_W): a third
  of 1F1B's bubble when the three passes cost the same (matrix FLOPs: F = B = W). ZB-H2, with
  about twice 1F1B's activation memory, and ZB-V (two chunks per rank in a V shape, 1F1B's memory)
  reach zero bubble in that setting. `parallel.pp_schedule: zero_bubble` means ZB-H1.
- DualPipe (DeepSeek-V3, arXiv 2412.19437, table 2): (p/2 - 1)(T_F&B + T_B - 3 T_W) of idle time,
  T_F&B the overlapped forward and backward of two micro-batches (T_F + T_B when nothing else
  overlaps): zero when the three passes cost the same. The trainer runs its V-shaped variant
  (`parallel.pp_schedule: dualpipev`, planned as this; ZB-V is `zbv`), pairing a forward with a
  backward and running the two at once (`parallel.pp_overlap`, tessera/parallel/pipeline_overlap.py),
  so that each one's expert all-to-all hides behind the other's compute (the time model's `ep_overlap`).
"""

from __future__ import annotations

from tessera.config.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zb_h2", "zb_v", "dualpipe")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, *, t_f: float = 1.0, t_b: float = 1.0,
                    t_w: float = 1.0) -> float:
    """Idle time / ideal time of one step. `t_f`, `t_b`, `t_w` are the forward, input-gradient and
    weight-gradient times of one micro-batch (only the zero-bubble schedules look at them)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pp_schedule={schedule!r} is invalid: one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"pipeline sizes p={p}, m={m}, v={v} are invalid: each must be >= 1")
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m)
    if schedule == "zero_bubble":
        return (p - 1) * max(t_f + t_b - t_w, 0.0) / (m * (t_f + t_b + t_w))
    if schedule == "dualpipe":
        return (p / 2 - 1) * max(t_f + t_b + t_b - 3 * t_w, 0.0) / (m * (t_f + t_b + t_w))
    return 0.0  # zb_h2 and zb_v, when t_f = t_b = t_w


def bubble_table(p: int, m: int, v: int = 2) -> dict[str, float]:
    """Bubble fraction of every schedule for p stages and m micro-batches (v chunks where used)."""
    return {"gpipe": bubble_fraction("gpipe", p, m), "1f1b": bubble_fraction("1f1b", p, m),
            f"interleaved_1f1b(v={v})": bubble_fraction("interleaved_1f1b", p, m, v),
            "zero_bubble(ZB-H1)": bubble_fraction("zero_bubble", p, m),
            "zb_h2": bubble_fraction("zb_h2", p, m), "zb_v": bubble_fraction("zb_v", p, m)}
