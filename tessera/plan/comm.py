"""Communication of one training step: every collective, its group, its size and how often it runs.

Bytes a rank sends per call follow the ring algorithms NCCL uses on a group of n ranks and a
full buffer of S bytes: all-reduce 2 S (n-1)/n, all-gather and reduce-scatter S (n-1)/n,
all-to-all S (n-1)/n, point-to-point S.

Per micro-batch of T = micro_batch x seq_len / cp tokens on a rank, per layer of its stage:
- TP (Shoeybi et al. 2019; Korthikanti et al. 2022): two all-reduces of T h activations forward
  and two backward; with sequence parallelism each becomes an all-gather plus a reduce-scatter of
  the same volume. Full recomputation repeats the forward ones. The vocabulary-parallel embedding
  adds one all-reduce forward on the first stage.
- CP (`cp_method`): alltoall (Ulysses, where cp divides the local query heads) re-splits q, k, v
  and the output between heads and sequence; allgather (and alltoall's fallback) all-gathers the
  keys and values of the whole sequence forward and again backward and reduce-scatters their
  gradients (MLA gathers its compressed latent); ring passes each rank's key/value block cp - 1
  times forward and backward and the fp32 gradient accumulators cp times backward. The latter two
  hide behind attention. These run on the layers that attend only: a recurrent layer (Gated
  DeltaNet, Kimi delta attention, Mamba-2; tessera.parallel.context_parallel_recurrent) all-gathers
  every part's last W-1 convolution inputs, and every part's transition and zero-start end state
  (fp32: heads x K x K and heads x K x V for the delta rule, heads and heads x P x N for SSD), one
  gather each, forward and again in a recomputed forward, and reduce-scatters their gradients
  backward; each is a state's size per part of a sequence (one part per rank, two under the zig-zag
  split), whatever its length, and on the critical path (`handoff_buffers`). An MLP-only layer
  (Nemotron-H) exchanges nothing.
- EP: dispatch and combine all-to-alls of the T k routed rows, forward and backward, and again in the
  forward a recomputed block replays unless it keeps them (recompute_save `dispatch`).
- PP: the stage boundary activations sent forward and their gradients backward, once per model
  chunk (v times with interleaving).
Data parallelism moves what the trainer's FSDP2 moves, unit by unit (`fsdp_units`: a block, the
root, a block's experts under ep, its router under low-precision parameters): each unit's gradient
is reduce-scattered once per step, in the last micro-batch's backward (gradient sync is off before
it, whatever the ZeRO stage), and all-reduced once across dp_replicate (hybrid sharding); weights
are all-gathered for every micro-batch's forward and, under ZeRO-3 (freed after the forward),
again for its backward (`_unit_collectives` has the pipeline case).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.plan.activation_dtypes import ActivationDtype, get_activation_dtype
from tessera.plan.layout import Layout, Workload
from tessera.plan.memory import Precision, RankParams
from tessera.plan.profile import ModelProfile, handoff_buffers

_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
           "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
           "send/recv": lambda n: 1.0}

# What compute a collective can run under: "none" (on the critical path), "attention" (the
# attention core of the same layer), "microbatch" (the forward+backward of the micro-batch it
# belongs to: FSDP prefetch and bucketed reduce-scatter), "last_backward" (only the backward of the
# step's last micro-batch), "first_forward" (the forward of the step's first micro-batch).
OVERLAPS = ("none", "attention", "microbatch", "last_backward", "first_forward")


@dataclass(frozen=True)
class Collective:
    group: str  # tp, cp, ep, pp, dp_shard, dp_replicate, ep_dp (the expert shard group)
    op: str  # all-reduce, all-gather, reduce-scatter, all-to-all, send/recv
    what: str
    size: float  # bytes of the full buffer of one call
    calls_per_microbatch: float  # calls each micro-batch makes
    calls_per_step: float  # calls once per step, outside the micro-batch loop
    group_size: int
    stride: int  # rank distance between group members (for the link they use)
    overlap: str

    def bytes_per_call(self) -> float:
        return self.size * _FACTOR[self.op](self.group_size)

    def bytes_per_step(self, microbatches: int) -> float:
        return self.bytes_per_call() * (self.calls_per_microbatch * microbatches + self.calls_per_step)

    def as_dict(self, microbatches: int) -> dict:
        return {"group": self.group, "op": self.op, "what": self.what, "size": self.size,
                "calls_per_step": self.calls_per_microbatch * microbatches + self.calls_per_step,
                "group_size": self.group_size, "bytes_per_step": self.bytes_per_step(microbatches),
                "overlap": self.overlap}


def group_strides(lay: Layout) -> dict[str, int]:
    """Rank distance inside each group, ranks ordered pp, dp_replicate, dp_shard, cp, tp (tp fastest)."""
    tp, cp, sh = lay.tp, lay.cp, lay.dp_shard
    return {"tp": 1, "cp": tp, "ep": tp, "dp_shard": tp, "ep_dp": tp * lay.ep,
            "dp_replicate": tp * cp * sh, "pp": tp * cp * sh * lay.dp_replicate}


# `add(group, group_size, op, what, size, per_microbatch, per_step=0.0, overlap="none")`: records a
# collective where its group has more than one rank and it moves something (stage_collectives).
AddCollective = Callable[..., None]


@dataclass(frozen=True)
class _StageCounts:
    """Layer counts of one pipeline stage that set how often its per-layer collectives run."""

    layers: int
    recomputed: int  # blocks replayed in backward: those the policy applies to under full and op, else 0
    cores: int  # attention cores re-run in backward: the layers the policy (any but none) applies to
    moe_layers: int
    moe_recomputed: int  # MoE blocks among `recomputed`

    @classmethod
    def of(cls, kinds: dict[tuple[bool, bool], int], recompute: str, save: tuple[str, ...] = ()) -> _StageCounts:
        """From `ModelProfile.stage_kinds`: layers counted by (is MoE, does the policy apply)."""
        # Collectives re-run in backward: the whole block's under full and op recomputation (the block
        # replays; collective outputs are not kept, except the expert all-to-alls' under op with
        # `dispatch` saved: kept_exchange.py), the attention core's under any policy.
        applied = sum(c for (_, applies), c in kinds.items() if applies)
        recomputed = applied if recompute in ("full", "op") else 0
        kept = recompute == "op" and "dispatch" in save
        moe_recomputed = sum(c for (moe, applies), c in kinds.items() if moe and applies) \
            if recomputed and not kept else 0
        return cls(layers=sum(kinds.values()), recomputed=recomputed, cores=applied,
                   moe_layers=sum(c for (moe, _), c in kinds.items() if moe), moe_recomputed=moe_recomputed)

    @classmethod
    def of_mixer(cls, mixers: dict[tuple[str, bool], int], mixer: str, recompute: str) -> _StageCounts:
        """The layers whose token mixer is `mixer`, from `ModelProfile.stage_mixers` (MoE not counted)."""
        layers = sum(c for (m, _), c in mixers.items() if m == mixer)
        applied = sum(c for (m, applies), c in mixers.items() if m == mixer and applies)
        return cls(layers=layers, recomputed=applied if recompute in ("full", "op") else 0, cores=applied,
                   moe_layers=0, moe_recomputed=0)


def stage_collectives(cfg: ModelConfig, lay: Layout, work: Workload, stage: int, params: RankParams,
                      precision: Precision, dtype: str, profile: ModelProfile | None = None) -> list[Collective]:
    """Every collective one rank of pipeline stage `stage` takes part in during a step."""
    prof = profile or ModelProfile.of(cfg, work.seq_len)
    dt = get_activation_dtype(dtype)
    st = group_strides(lay)
    kinds = prof.stage_kinds(lay.pp, lay.vpp, stage, lay.recompute, lay.recompute_interval)
    T = work.micro_batch * work.seq_len / lay.cp
    out: list[Collective] = []

    def add(group: str, size_: int, op: str, what: str, size: float, per_mb: float, per_step: float = 0.0,
            overlap: str = "none") -> None:
        if size_ > 1 and size > 0 and (per_mb > 0 or per_step > 0):
            out.append(Collective(group, op, what, size, per_mb, per_step, size_, st[group], overlap))

    counts = _StageCounts.of(kinds, lay.recompute, lay.recompute_save)
    _tp_collectives(lay, stage, counts, T * cfg.dim * dt.compute, add)
    if lay.cp > 1:
        mixers = prof.stage_mixers(lay.pp, lay.vpp, stage, lay.recompute, lay.recompute_interval)
        _cp_collectives(cfg, lay, _StageCounts.of_mixer(mixers, "attention", lay.recompute), T, dt, add)
        for mixer in ("delta", "ssd"):
            _handoff_collectives(cfg, lay, work, mixer, _StageCounts.of_mixer(mixers, mixer, lay.recompute), dt, add)
    if lay.ep > 1 and counts.moe_layers:
        # forward and backward, again in a replayed block: the dispatch sends the MoE input's rows (the
        # residual dtype, or the compute dtype with ep_dispatch_dtype=compute; its gradient the same), the
        # combine the experts' outputs (the compute dtype)
        rows, calls = T * cfg.moe.top_k * cfg.dim, 2 * counts.moe_layers + counts.moe_recomputed
        sent = dt.compute if lay.ep_dispatch_dtype == "compute" else dt.residual
        add("ep", lay.ep, "all-to-all", "MoE token dispatch", rows * sent, calls)
        add("ep", lay.ep, "all-to-all", "MoE combine", rows * dt.compute, calls)
    if lay.pp > 1:
        boundary = T * cfg.dim * dt.residual / (lay.tp if lay.sp else 1)
        add("pp", lay.pp, "send/recv", "stage boundary activations + gradients", boundary, 2 * lay.vpp)
    for unit in fsdp_units(lay, params, precision):
        _unit_collectives(unit, lay, add)
    return out


def _tp_collectives(lay: Layout, stage: int, counts: _StageCounts, act: float, add: AddCollective) -> None:
    """Per block two all-reduces of the `act` bytes of activations forward, two backward and two in a
    recomputed forward (with sequence parallelism each an all-gather plus a reduce-scatter); the first
    stage's vocabulary-parallel embedding one more."""
    n, recomputed = counts.layers, counts.recomputed
    if lay.sp:
        calls = 2 * n + 2 * n + 2 * recomputed  # forward, backward, recomputed forward: per block one each
        add("tp", lay.tp, "all-gather", "sequence-parallel activations", act, calls)
        add("tp", lay.tp, "reduce-scatter", "sequence-parallel activations", act, calls)
    else:
        add("tp", lay.tp, "all-reduce", "tensor-parallel activations", act, 4 * n + 2 * recomputed)
    if stage == 0:
        add("tp", lay.tp, "all-reduce", "vocab-parallel embedding", act, 1)


def _cp_collectives(cfg: ModelConfig, lay: Layout, counts: _StageCounts, T: float, dt: ActivationDtype,
                    add: AddCollective) -> None:
    """Context parallelism (cp > 1) of `T` tokens per rank, by the attention `cp_method` runs."""
    if lay.cp_method == "ring":
        _ring_attention(cfg, lay, counts, T, dt, add)
    elif lay.cp_method == "alltoall" and (cfg.n_heads // lay.tp) % lay.cp == 0:
        _ulysses_attention(cfg, lay, counts, T, dt, add)
    else:  # allgather, and alltoall where cp does not divide the local query heads
        _allgather_attention(cfg, lay, counts, T, dt, add)


def _ring_attention(cfg: ModelConfig, lay: Layout, counts: _StageCounts, T: float, dt: ActivationDtype,
                    add: AddCollective) -> None:
    """Ring attention (tessera.parallel.ring_attention): every layer passes this rank's k/v block
    (MLA: its decompressed heads) cp - 1 hops in the forward, the recomputed forward and the backward,
    and the block's fp32 dk/dv accumulator cp hops in the backward."""
    n = counts.layers
    if cfg.mla is not None:
        kv = cfg.n_heads / lay.tp * (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim + cfg.mla.v_head_dim)
    else:
        kv = 2 * max(cfg.n_kv_heads // lay.tp, 1) * cfg.head_dim
    add("cp", lay.cp, "send/recv", "key/value blocks around the ring", T * kv * dt.compute,
        (lay.cp - 1) * (2 * n + counts.cores), overlap="attention")
    add("cp", lay.cp, "send/recv", "key/value gradient accumulators around the ring", T * kv * 4,
        lay.cp * n, overlap="attention")


def _ulysses_attention(cfg: ModelConfig, lay: Layout, counts: _StageCounts, T: float, dt: ActivationDtype,
                       add: AddCollective) -> None:
    """All-to-all attention (DeepSpeed-Ulysses), what tessera.parallel.context_parallel picks when cp
    divides the local query heads: q, k, v go heads <-> sequence and the output back, per layer,
    forward, backward and recomputed forward. GQA kv heads are repeated until cp divides them."""
    q_heads = cfg.n_heads // lay.tp
    if cfg.mla is not None:
        m = cfg.mla
        per_token = q_heads * (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 2 * m.v_head_dim)
    else:
        kv_heads = max(cfg.n_kv_heads // lay.tp, 1)
        kv_heads *= next(r for r in range(1, q_heads // kv_heads + 1)
                         if (q_heads // kv_heads) % r == 0 and (kv_heads * r) % lay.cp == 0)
        per_token = (2 * q_heads + 2 * kv_heads) * cfg.head_dim
    add("cp", lay.cp, "all-to-all", "q, k, v and attention output, heads <-> sequence (Ulysses)",
        T * per_token * dt.compute, 2 * counts.layers + counts.cores)


def _allgather_attention(cfg: ModelConfig, lay: Layout, counts: _StageCounts, T: float, dt: ActivationDtype,
                         add: AddCollective) -> None:
    """The all-gather attention (Llama 3): whole-sequence keys and values (MLA: its compressed
    latent) on every rank, gathered forward and again backward, their gradients reduce-scattered."""
    if cfg.mla is not None:
        kv = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    else:
        kv = 2 * cfg.n_kv_heads * cfg.head_dim / lay.tp
    full = T * lay.cp * kv * dt.compute
    add("cp", lay.cp, "all-gather", "keys/values of the whole sequence", full, 2 * counts.layers + counts.cores,
        overlap="attention")
    add("cp", lay.cp, "reduce-scatter", "key/value gradients", full, counts.layers, overlap="attention")


def _handoff_collectives(cfg: ModelConfig, lay: Layout, work: Workload, mixer: str, counts: _StageCounts,
                         dt: ActivationDtype, add: AddCollective) -> None:
    """The state handoff of the stage's `mixer` layers: each buffer all-gathered in the forward and a
    recomputed forward, its gradient reduce-scattered in the backward (module docstring)."""
    if not counts.layers:
        return
    for what, size in handoff_buffers(cfg, mixer, lay, work.micro_batch, dt.compute).items():
        add("cp", lay.cp, "all-gather", f"recurrent state handoff ({mixer}): {what}", size,
            counts.layers + counts.recomputed)
        add("cp", lay.cp, "reduce-scatter", f"recurrent state handoff ({mixer}): {what} gradients", size,
            counts.layers)


@dataclass(frozen=True)
class FsdpUnit:
    """`count` FSDP units of `params` parameters each (tessera.parallel.data_parallel): a decoder
    block, the root (embedding, final norm, head), a block's experts (ep > 1) or its router (its own
    unit in fp32 under low-precision parameters)."""

    label: str
    group: str  # dp_shard (dense mesh) or ep_dp (the expert mesh)
    shard: int
    count: int
    params: float  # of one unit
    weight_bytes: int
    grad_bytes: int
    reshards_after_forward: bool  # zero_stage 3 blocks; the root stays gathered until its backward


def fsdp_units(lay: Layout, params: RankParams, precision: Precision) -> list[FsdpUnit]:
    wb, gb, z3 = precision.weight_bytes, precision.grad_bytes, lay.zero_stage == 3 and lay.optimizer == "fsdp"
    router = params.router if wb < 4 else 0.0
    experts_apart = lay.ep > 1
    blocks = params.dense - params.root - router + (0.0 if experts_apart else params.expert)
    units = [FsdpUnit("", "dp_shard", lay.dense_shard, params.blocks, blocks / max(params.blocks, 1), wb, gb, z3),
             FsdpUnit("root ", "dp_shard", lay.dense_shard, 1 if params.root > 0 else 0, params.root, wb, gb, False)]
    if router:
        units.append(FsdpUnit("router ", "dp_shard", lay.dense_shard, params.moe_blocks,
                              router / params.moe_blocks, 4, 4, z3))
    if experts_apart and params.moe_blocks:
        units.append(FsdpUnit("expert ", "ep_dp", lay.expert_shard, params.moe_blocks,
                              params.expert / params.moe_blocks, wb, gb, z3))
    return [u for u in units if u.count > 0 and u.params > 0]


def _unit_collectives(u: FsdpUnit, lay: Layout, add: AddCollective) -> None:
    """What the trainer's FSDP2 does for `u` in one step of m micro-batches.

    Gradients: one reduce-scatter per unit per step, in the last micro-batch's backward (gradient
    sync is off before it), then one all-reduce across dp_replicate. Weights: without pipeline
    parallelism every micro-batch gathers each unit for its forward and, where the unit was freed
    after the forward (zero_stage 3 blocks), again for its backward; the weights are freed after each
    backward. Under pipeline parallelism torch's schedules keep them gathered until the step's last
    backward, so units that are not freed after the forward are gathered once per step."""
    weights, grads = u.params * u.weight_bytes, u.params * u.grad_bytes
    if lay.optimizer == "distributed":  # buckets: gradients reduce-scattered, updated weights gathered, once a step
        add(u.group, u.shard, "reduce-scatter", f"{u.label}gradients (buckets)", grads, 0, u.count,
            overlap="last_backward")
        add(u.group, u.shard, "all-gather", f"{u.label}updated weights (buckets)", weights, 0, u.count,
            overlap="first_forward")
        return
    if u.reshards_after_forward:
        add(u.group, u.shard, "all-gather", f"{u.label}weights (forward + backward)", weights, 2 * u.count,
            overlap="microbatch")
    elif lay.pp > 1:
        add(u.group, u.shard, "all-gather", f"{u.label}weights", weights, 0, u.count, overlap="first_forward")
    else:
        add(u.group, u.shard, "all-gather", f"{u.label}weights", weights, u.count, overlap="microbatch")
    add(u.group, u.shard, "reduce-scatter", f"{u.label}gradients", grads, 0, u.count, overlap="last_backward")
    add("dp_replicate", lay.dp_replicate, "all-reduce", f"{u.label}gradients across replicas",
        grads / max(u.shard, 1), 0, u.count, overlap="last_backward")
