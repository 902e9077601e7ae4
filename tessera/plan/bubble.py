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

Splitting the backward costs recomputation: torch runs a split backward's weight pass
(`stage_backward_weight`) as one autograd call per group of weights (a weight and the bias of its
product), and a block checkpointed by full or operator-level recomputation replays its forward in
each call that reaches it, after the input pass's replay. So a recomputed block replays once per
micro-batch whose backward runs whole, and 1 + (its weight groups) times per split one
(`block_replays`; the groups: tessera.models.counting.layer_weight_groups). Which backwards torch
splits (`split_backwards`, from its action lists, checked against the trainer in
tests/plan/test_split_backward_replays.py): zero_bubble and zbv every micro-batch of every stage but
the first (whose input needs no gradient: its input pass is the whole backward); DualPipeV only in
its warm-up and cool-down, p - ceil(s / 2) micro-batches on the first half's stage s > 0 and
p - 1 - floor(r / 2) on rank r's second stage.
"""

from __future__ import annotations

import math

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.models.counting import layer_weight_groups

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


# the planner's names of the trainer's zero_bubble, zbv, dualpipev
SPLIT_SCHEDULES = ("zero_bubble", "zb_v", "dualpipe")


def _stage_ranks(schedule: str, p: int, vpp: int) -> list[int]:
    """The pipeline rank of each stage, as the trainer places them: in a V for zb_v and dualpipe
    (stage s on rank s, then 2 p - 1 - s), looped otherwise (s mod p)."""
    if schedule in ("zb_v", "dualpipe"):
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * vpp)]


def _split_stage(schedule: str, p: int, m: int, stage: int) -> int:
    """Micro-batches per step whose backward torch splits into input and weight passes on `stage`."""
    if p == 1 or stage == 0 or schedule not in SPLIT_SCHEDULES:
        return 0
    if schedule != "dualpipe":
        return m
    split = p - math.ceil(stage / 2) if stage < p else p - 1 - (2 * p - 1 - stage) // 2
    return min(split, m)


def split_backwards(schedule: str, n_layers: int, p: int, m: int, vpp: int = 1) -> list[tuple[int, int]]:
    """Each layer's (pipeline rank, micro-batches per step whose backward torch splits) as the trainer
    places layers on stages (consecutive, earlier stages taking the remainder) and stages on ranks."""
    ranks = _stage_ranks(schedule, p, vpp)
    base, extra = divmod(n_layers, len(ranks))
    out: list[tuple[int, int]] = []
    for stage, rank in enumerate(ranks):
        out += [(rank, _split_stage(schedule, p, m, stage))] * (base + (1 if stage < extra else 0))
    return out


def block_replays(split: int, m: int, weight_groups: int) -> float:
    """Replays per micro-batch of a block that full or operator-level recomputation checkpoints: one per
    backward, and one more per weight group in each of the `split` split backwards' weight passes."""
    return 1.0 + split * weight_groups / m


def layer_replays(cfg: ModelConfig, schedule: str, p: int, m: int, recompute: str, vpp: int = 1
                  ) -> list[tuple[int, float]]:
    """Each layer's (pipeline rank, replays per micro-batch should full or operator-level recomputation
    checkpoint it): `block_replays` on split schedules, once otherwise (and 1 under other policies)."""
    placed = split_backwards(schedule, cfg.n_layers, p, m, vpp)
    if recompute not in ("full", "op"):
        return [(rank, 1.0) for rank, _ in placed]
    return [(rank, block_replays(split, m, layer_weight_groups(cfg, i))) for i, (rank, split) in enumerate(placed)]


def bubble_table(p: int, m: int, v: int = 2) -> dict[str, float]:
    """Bubble fraction of every schedule for p stages and m micro-batches (v chunks where used)."""
    return {"gpipe": bubble_fraction("gpipe", p, m), "1f1b": bubble_fraction("1f1b", p, m),
            f"interleaved_1f1b(v={v})": bubble_fraction("interleaved_1f1b", p, m, v),
            "zero_bubble(ZB-H1)": bubble_fraction("zero_bubble", p, m),
            "zb_h2": bubble_fraction("zb_h2", p, m), "zb_v": bubble_fraction("zb_v", p, m)}
