"""A step's loss and MoE statistics, accumulated over a rank's micro-batches and summed over ranks
(every step engine keeps its statistics in a `StepStats`; one process has nothing to sum).

Each rank adds up what it computed: the token-loss sum of its rows (on the last pipeline stage),
and, per micro-batch, the MoE auxiliary loss, its named parts and the routing counts of the
layers it holds. `reduce_over_ranks` then makes the step's global figures, the same on every rank:

- summed over data-parallel ranks (`dp`), which read different rows, and context-parallel ranks
  (`cp`), which hold different chunks of the same rows (`token_dim`). Tensor- and sequence-parallel
  peers compute the same values (every tp rank routes the whole micro-batch), so they are not
  added again. Routing counts are summed over dp only: under cp the router already returns the
  micro-batch's counts on every cp rank.
- combined over pipeline stages (`pp`): a stage holds the loss (last stage) or the statistics of
  its own layers only, so the stages' dictionaries are merged.

The summed routing counts drive the aux-loss-free expert-bias step, which must be identical on
every rank. `step_result` turns the global figures into the step's `StepResult` (results.py).

The sums are kept on the device (fp64, the same additions as Python floats) while micro-batches
run and read on the host once, when the step's figures are needed (`settle`): reading a loss per
micro-batch would make the host wait for each micro-batch's backward before it could queue the
next forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tessera.parallel.data_parallel_batch import global_sum, sum_expert_counts, token_dim
from tessera.parallel.dims import ParallelDims
from tessera.train.results import StepResult


@dataclass
class StepStats:
    loss_sum: float = 0.0  # sum of token cross-entropies (fp64 accumulation)
    aux_total: float = 0.0  # sum over micro-batches of the weighted auxiliary loss
    aux_parts: dict[str, float] = field(default_factory=dict)  # "layer{i}/{name}" -> sum over micro-batches
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> routing slots, summed
    distill_sum: float | None = None  # sum of the KD term's token sums (train.distill), None without a teacher
    hidden_sum: float | None = None  # sum of the hidden-state matching sums (train.distill.hidden_layers)
    mtp_sums: dict[int, float] = field(default_factory=dict)  # MTP depth -> sum of its token losses
    # fp64 device sums not yet read on the host: "loss", "aux", "aux/<name>"
    pending: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def _add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.pending[key] = self.pending[key] + value if key in self.pending else value

    def add_loss(self, micro_sum: torch.Tensor) -> None:
        self._add("loss", micro_sum)

    def add_distill(self, micro_kd_sum: torch.Tensor) -> None:
        """A micro-batch's KD term (T^2 * summed KL over its loss tokens: distill_loss.py)."""
        self._add("distill", micro_kd_sum)

    def add_hidden(self, micro_hidden_sum: torch.Tensor) -> None:
        """A micro-batch's hidden-state matching sum (hidden_match.py)."""
        self._add("hidden", micro_hidden_sum)

    def add_routing(self, out) -> None:
        """The auxiliary losses and routing counts of one micro-batch's ModelOutput."""
        self._add("aux", out.aux_loss)
        for name, value in out.aux_losses.items():
            self._add(f"aux/{name}", value)
        for depth, value in getattr(out, "mtp_loss_sums", {}).items():
            self._add(f"mtp/{depth}", value)
        for layer, c in out.expert_counts.items():
            c = c.detach()
            self.counts[layer] = self.counts[layer] + c if layer in self.counts else c.clone()

    def settle(self) -> StepStats:
        """Read the device sums on the host (one transfer) into the float fields; returns self."""
        if not self.pending:
            return self
        keys = list(self.pending)
        values = torch.stack([self.pending[k].to(self.pending[keys[0]].device) for k in keys]).tolist()
        self.pending = {}
        for key, value in zip(keys, values, strict=True):
            if key == "loss":
                self.loss_sum += value
            elif key == "aux":
                self.aux_total += value
            elif key == "distill":
                self.distill_sum = (self.distill_sum or 0.0) + value
            elif key == "hidden":
                self.hidden_sum = (self.hidden_sum or 0.0) + value
            elif key.startswith("mtp/"):
                depth = int(key.removeprefix("mtp/"))
                self.mtp_sums[depth] = self.mtp_sums.get(depth, 0.0) + value
            else:
                name = key.removeprefix("aux/")
                self.aux_parts[name] = self.aux_parts.get(name, 0.0) + value
        return self


def reduce_over_ranks(local: StepStats, dims: ParallelDims | None) -> StepStats:
    """The step's statistics summed over data-parallel (and cp) ranks and merged over pipeline
    stages (`dims` None: one process, `local` is the step's)."""
    local.settle()
    if dims is None:
        return local
    names = sorted(local.aux_parts)
    depths = sorted(local.mtp_sums)
    extra = {k: v for k, v in (("distill_sum", local.distill_sum), ("hidden_sum", local.hidden_sum)) if v is not None}
    vec = torch.tensor([local.loss_sum, local.aux_total, *(local.aux_parts[n] for n in names),
                        *(local.mtp_sums[d] for d in depths), *extra.values()], dtype=torch.float64)
    vec = global_sum(vec, dims, token_dim(dims))
    counts = sum_expert_counts(local.counts, dims)
    mtp_at = 2 + len(names)
    out = StepStats(float(vec[0]), float(vec[1]), dict(zip(names, vec[2:mtp_at].tolist())),
                    {k: v.cpu() for k, v in counts.items()},
                    mtp_sums=dict(zip(depths, vec[mtp_at:mtp_at + len(depths)].tolist())),
                    **dict(zip(extra, vec[mtp_at + len(depths):].tolist())))
    if dims.pp == 1:
        return out
    stages: list[StepStats | None] = [None] * dims.pp
    dist.all_gather_object(stages, out, group=dims["pp"].get_group())
    merged = StepStats()
    for s in stages:
        merged.loss_sum += s.loss_sum
        merged.aux_total += s.aux_total
        merged.aux_parts.update(s.aux_parts)
        merged.counts.update(s.counts)
        merged.mtp_sums.update(s.mtp_sums)
        if s.distill_sum is not None:
            merged.distill_sum = (merged.distill_sum or 0.0) + s.distill_sum
    return merged


def step_result(stats: StepStats, loss_tokens: int, micro_batches: int, tokens: int) -> StepResult:
    """The step's `StepResult` from its global StepStats: loss per loss token, auxiliary losses per
    micro-batch (`micro_batches` of the whole global batch), routing counts; with a teacher
    (train.distill) the KD term per loss token, with hidden-state matching that term per loss token,
    with multi-token prediction each depth's token-loss sum per main loss token."""
    stats.settle()
    n = max(loss_tokens, 1)
    return StepResult(
        loss=stats.loss_sum / n, tokens=tokens, loss_tokens=loss_tokens, aux_loss=stats.aux_total / micro_batches,
        aux_parts={k: v / micro_batches for k, v in stats.aux_parts.items()}, counts=stats.counts,
        distill_loss=stats.distill_sum / n if stats.distill_sum is not None else None,
        distill_hidden_loss=stats.hidden_sum / n if stats.hidden_sum is not None else None,
        mtp_losses={k: v / n for k, v in sorted(stats.mtp_sums.items())})
