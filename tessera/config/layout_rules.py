"""Whether a parallel layout can run a model: every rule in one torch-free place.

The trainer (`tessera.parallel.dims.ParallelDims.validate`, before any process allocates memory)
and the planner (`tessera.plan.layout.layout_problems`, for every layout its search proposes)
both ask `layout_problems`; `pipeline_microbatch_problem` is the pipeline schedules' rule on the
micro-batch count (torch's schedules raise a bare error after the model is built otherwise).

Two kinds of rule:
- divisibility: world = pp x dp_replicate x dp_shard x cp x tp; tp divides the heads, KV heads,
  vocabulary and FFN sizes; ep divides the experts and dp_shard x cp (experts fold over those
  ranks) and is a multiple of cp; cp divides the sequence, and with sp tp divides each cp chunk;
  pp x vpp stages need a layer each.
- what is supported under which parallelism: sp without tp. (Tied embeddings under tp and pp,
  multi-head latent attention under tp, and the sequence-level balancing loss and Sinkhorn routing
  under cp are supported.)
- context-parallel method: allgather and ring use the zig-zag split, so 2 cp divides the sequence
  (`cp_layout`); a hybrid's recurrent layers need each part of it to hold the short convolution's
  earlier inputs.
Each message names the dimension, the value and what it fails against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessera.config.errors import require

if TYPE_CHECKING:
    from tessera.config.model import ModelConfig

# Pipeline schedules that run m // pp rounds of equal size (torch's interleaved / zero-bubble ones).
ROUND_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class LayoutSizes:
    """Ranks along every mesh dimension (dp_shard resolved)."""

    tp: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    cp_method: str = "alltoall"

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp


def cp_layout(cp_method: str) -> str:
    """How a sequence is split over the cp ranks for `parallel.cp_method`: "contiguous" (rank r holds
    chunk r of cp) for alltoall, "zigzag" (rank r holds chunks r and 2 cp - 1 - r of 2 cp, so every
    rank gets the same causal work) for allgather and ring."""
    return "contiguous" if cp_method == "alltoall" else "zigzag"


def _divides(dim: str, size: int, what: str, value: int) -> str | None:
    if size > 1 and value % size != 0:
        return f"{dim}={size} does not divide {what}={value}; choose a {dim} that divides {value}"
    return None


def _recurrent_problems(m, s: LayoutSizes, seq_len: int | None) -> list[str | None]:
    """A hybrid's recurrent layers: tp splits their heads by key-head groups (Gated DeltaNet) or groups
    (Mamba-2). cp takes both: each rank runs them over its own part of the sequence, from the state the
    previous part hands on (tessera/parallel/context_parallel_recurrent.py), whose convolution inputs
    a part must hold a window's worth of."""
    out: list[str | None] = []
    if m.linear_attention is not None:
        out.append(_divides("tp", s.tp, "model.linear_attention.n_key_heads", m.linear_attention.n_key_heads))
    if m.mamba is not None:  # heads split with their groups
        out.append(_divides("tp", s.tp, "model.mamba.n_groups", m.mamba.n_groups))
    for key, sizes in (("model.linear_attention.conv_width", m.linear_attention), ("model.mamba.conv_width", m.mamba)):
        parts = s.cp * (2 if cp_layout(s.cp_method) == "zigzag" else 1)
        if sizes is not None and s.cp > 1 and seq_len is not None and 0 < seq_len // parts < sizes.conv_width - 1:
            out.append(f"cp={s.cp} ({s.cp_method}) cuts each sequence into {parts} parts of {seq_len // parts} tokens, "
                       f"fewer than the {sizes.conv_width - 1} earlier inputs of the short convolution ({key}="
                       f"{sizes.conv_width}) that a part hands on; choose train.seq_len >= "
                       f"{parts * (sizes.conv_width - 1)} or a smaller cp")
    if m.sublayers is not None and "moe" in m.sublayers and s.pp > 1:
        out.append(f"pp={s.pp} is not supported for the moe sublayers of model.sublayers (Nemotron-H's MoE "
                   "variants) yet: pipeline stages of them are not built or checked; use pp=1 (fsdp, tp, tp + sp "
                   "and ep take the model)")
    return out


def layout_problems(m: ModelConfig, sizes: LayoutSizes, *, world_size: int | None = None,
                    seq_len: int | None = None) -> list[str]:
    """Every reason `sizes` cannot run model `m` (empty when it can), in the order the trainer
    reports them. `world_size` and `seq_len` are checked when given."""
    s = sizes
    out: list[str | None] = []
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "vpp"):
        if getattr(s, name) < 1:
            out.append(f"{name}={getattr(s, name)} is invalid: must be >= 1")
    if world_size is not None and s.world != world_size:
        out.append(f"pp={s.pp} x dp_replicate={s.dp_replicate} x dp_shard={s.dp_shard} x cp={s.cp} x tp={s.tp} = "
                   f"{s.world} ranks, but the world has {world_size}")
    if s.sp and s.tp == 1:
        out.append("sp=true needs tp > 1: sequence parallelism splits the tensor-parallel group")
    if s.tp > 1:
        out.append(_divides("tp", s.tp, "model.n_heads", m.n_heads))
        if m.mla is None:
            out.append(_divides("tp", s.tp, "model.n_kv_heads", m.n_kv_heads))
        out.append(_divides("tp", s.tp, "model.vocab_size", m.vocab_size))
        if m.qk_norm_all_heads:
            out.append(f"tp={s.tp} cannot split a QK norm over all heads (model.qk_norm_all_heads=true, OLMo 2): "
                       "its mean spans every rank's heads; use tp=1 (fsdp, pp, cp and dp take the model)")
        if any(not m.is_moe_layer(i) for i in range(m.n_layers)):
            out.append(_divides("tp", s.tp, "model.ffn_dim", m.ffn_dim))
        if m.moe is not None:
            out.append(_divides("tp", s.tp, "model.moe.ffn_dim", m.moe.ffn_dim))
            if m.moe.shared_ffn_dim > 0:
                out.append(_divides("tp", s.tp, "model.moe.shared_ffn_dim", m.moe.shared_ffn_dim))
        if s.sp and seq_len is not None and seq_len % s.cp == 0:
            what = "sequence length (sp=true splits it)" if s.cp == 1 else \
                f"the context-parallel chunk (sequence length {seq_len} / cp={s.cp}; sp=true splits it)"
            out.append(_divides("tp", s.tp, what, seq_len // s.cp))
    out.extend(_recurrent_problems(m, s, seq_len))
    if s.ep > 1:
        if m.moe is None:
            out.append(f"ep={s.ep} needs an MoE model, but model.moe is not set")
        else:
            out.append(_divides("ep", s.ep, "model.moe.num_experts", m.moe.num_experts))
        out.append(_divides("ep", s.ep, "dp_shard x cp", s.dp_shard * s.cp))
        if s.ep % s.cp != 0:
            out.append(f"ep={s.ep} must be a multiple of cp={s.cp}: experts fold over all of cp and part of dp_shard")
    if s.cp > 1:
        out.extend(_cp_problems(m, s, seq_len))
    stages = s.pp * s.vpp
    if stages > m.n_layers:
        out.append(f"pp x vpp = {s.pp} x {s.vpp} = {stages} pipeline stages is more than model.n_layers={m.n_layers}; "
                   "every stage needs at least one layer")
    return [p for p in out if p is not None]


def _cp_problems(m: ModelConfig, s: LayoutSizes, seq_len: int | None) -> list[str | None]:
    """Why cp > 1 cannot run model `m` (layout_problems' part for context parallelism)."""
    out: list[str | None] = []
    if m.attention_sinks:
        out.append(f"cp={s.cp} cannot attend with attention sinks (model.attention_sinks=true, gpt-oss): the "
                   "context-parallel attention cores take none; use cp=1 (tp, ep, fsdp and pp take the model)")
    if seq_len is not None:
        out.append(_divides("cp", s.cp, "sequence length (train.seq_len)", seq_len))
        if cp_layout(s.cp_method) == "zigzag" and seq_len % s.cp == 0 and seq_len % (2 * s.cp):
            out.append(f"cp_method={s.cp_method} cuts each sequence into 2 x cp={2 * s.cp} chunks (zig-zag), "
                       f"which does not divide sequence length (train.seq_len)={seq_len}; choose a seq_len "
                       f"that {2 * s.cp} divides or cp_method=alltoall")
    return out


def pipeline_microbatch_problem(schedule: str, microbatches: int, pp: int) -> str | None:
    """Why `microbatches` per step cannot run `schedule` over `pp` ranks (None when they can):
    1F1B and the round-based schedules need one micro-batch per stage rank (m >= pp; GPipe takes
    any m); the round-based ones also run max(1, m // pp) rounds of equal size."""
    if pp <= 1 or schedule == "gpipe":
        return None
    if schedule in ("dualpipev", "dualpipe") and microbatches < 2 * pp:
        return (f"{microbatches} micro-batches per step are fewer than 2 x pp = {2 * pp}: the {schedule} schedule "
                "needs one per stage (two stages per rank)")
    if microbatches < pp:
        return (f"{microbatches} micro-batches per step are fewer than pp={pp}: the {schedule} schedule needs "
                "one per stage")
    rounds = max(1, microbatches // pp)
    if schedule in ROUND_SCHEDULES and microbatches % rounds:
        return (f"{microbatches} micro-batches per step are invalid for {schedule} with pp={pp}: it runs "
                f"m // pp = {rounds} rounds of equal size, so m must be in [pp, 2 pp) or a multiple of m // pp")
    return None


def need_data_parallel_only(parallel: Any, setting: str, what: str, tensor_parallel: bool = False) -> None:
    """Refuse (ConfigError naming the key) pp, tp, ep or cp above 1 for a `setting` that trains
    `what` in one process or under dp_replicate / dp_shard only (and tp, with `tensor_parallel`)."""
    keys = ("pp", "ep", "cp") if tensor_parallel else ("pp", "tp", "ep", "cp")
    layouts = "dp_replicate / dp_shard / tp" if tensor_parallel else "dp_replicate / dp_shard"
    for key in keys:
        value = getattr(parallel, key)
        require(value == 1, f"parallel.{key}", value,
                f"1 with {setting} ({what} runs in one process and under {layouts} only)")
