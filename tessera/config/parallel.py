"""Parallel layout: how many ranks along each named mesh dimension, and how memory is traded.

Dense parameters: world = pp x dp_replicate x dp_shard x cp x tp (tp innermost, pp outermost).
Experts fold onto the same ranks: ep divides dp_shard x cp; experts are data-parallel over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.errors import ConfigError
from tessera.config.limits import MAX_PARALLEL_SIZE

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per pp rank, placed in a V (tessera/parallel/pipeline.py)


def stages_per_rank(schedule: str, vpp: int) -> int:
    """Pipeline stages each pp rank holds: vpp, or two for the V schedules (zbv, dualpipev)."""
    return 2 if schedule in V_SCHEDULES else vpp


# Activation recomputation policies (tessera/parallel/memory/activation_checkpoint.py; docs/planning.md,
# "Recomputation and activation policies"): none; selective (Megatron's: the attention core re-runs
# in backward, Korthikanti et al. 2022); op (torchtitan's operator-level policy: the block re-runs in
# backward except the operators named by `recompute_save`, whose outputs are kept); full (the block
# keeps only its input). `recompute_interval` k applies any of them to every k-th block. The one
# list: the trainer, the FLOP count (models/flops.py) and the planner's estimates and search read it.
RECOMPUTE_CHOICES = ("none", "selective", "op", "full")
# What `recompute=op` keeps (an operator's output is kept when any entry selects it):
#   attention_core     the attention kernel's outputs (output and log-sum-exp)
#   matmuls            every matrix product's output
#   alternate_matmuls  every other matrix product of a block, the 1st, 3rd, ... in the order the block
#                      runs them (torchtitan's policy, which keeps half the products' outputs)
#   attention_in       products from the block's normalised input into attention: q, k, v (MLA: wq or
#                      the latents wq_a, wkv_a)
#   mla_up             MLA's up-projections from the latents (wq_b, wkv_b)
#   attention_out      the attention output projection (wo)
#   router             the MoE router's logits and the shared-expert gate
#   mlp_in             SwiGLU gate and up products (dense MLP, routed experts, shared experts)
#   mlp_out            SwiGLU down products
#   dispatch           the MoE all-to-alls' received rows (dispatch and combine) and counts: the replay
#                      takes them instead of sending again, so backward sends only the gradients
#                      (tessera/parallel/memory/kept_exchange.py; the alltoall dispatcher under ep > 1)
# Norms, RoPE, activations, casts and routing always re-run, and so does the dispatch unless kept.
# DeepSeek-V3's recipe (recompute every RMSNorm and the MLA up-projections, keep the SwiGLU inputs and
# the dispatched tokens; arXiv 2412.19437, sections 3.2 and 3.3.3) is
# [attention_core, attention_in, router, mlp_in, dispatch].
RECOMPUTE_ROLES = ("attention_in", "mla_up", "attention_out", "router", "mlp_in", "mlp_out")
RECOMPUTE_SAVE_CHOICES = ("attention_core", "matmuls", "alternate_matmuls", *RECOMPUTE_ROLES, "dispatch")
TORCHTITAN_SAVE = ("attention_core", "alternate_matmuls")
# Outputs `recompute=op` may keep in FP8 (E4M3, one fp32 scale per row) instead of the compute dtype:
# matrix products, and the expert exchanges' received rows (`dispatch`: DeepSeek-V3 dispatches, and so
# keeps, its tokens in FP8); the attention core (its log-sum-exp is fp32) and the router (fp32 by design) stay.
ACTIVATION_FP8_CHOICES = ("attention_in", "mla_up", "attention_out", "mlp_in", "mlp_out", "dispatch")
EP_DISPATCHERS = ("alltoall", "allgather")
EP_DISPATCH_DTYPES = ("input", "compute")
CP_METHODS = ("alltoall", "allgather", "ring")
OPTIMIZERS = ("fsdp", "distributed")


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # replicated data parallel (the outer level of hybrid sharding)
    dp_shard: int = -1  # sharded data parallel; -1 fills what the other sizes leave of the world
    tp: int = 1  # tensor parallel (inside a node)
    sp: bool = False  # sequence parallel: norms and dropout regions split along the sequence under tp
    pp: int = 1  # pipeline stages
    pp_schedule: str = "1f1b"  # one of PP_SCHEDULES
    vpp: int = 1  # virtual stages per rank (interleaved 1F1B)
    # dualpipev: run each paired forward and backward at once (two threads, the forward's expert all-to-alls
    # on a second communicator), so that one micro-batch's all-to-all hides behind the other's compute, as
    # DeepSeek-V3's DualPipe does (tessera/parallel/pipeline_overlap.py). Applies with tp = cp = 1 (their
    # collectives have no second communicator); elsewhere, or false, the pair runs one after the other.
    # Same numbers either way; the planner assumes the all-to-all hidden where it applies.
    pp_overlap: bool = True
    # Micro-batches per step and data-parallel rank in the pipeline (pp > 1); None = the rank's rows /
    # train.micro_batch_size. Any count that divides the rows: the loss is normalised by the loss tokens
    # of the whole global batch, so a dense model changes only memory and the bubble; an MoE model's aux
    # losses and expert capacity are per pipeline micro-batch (rows / microbatches samples; Megatron-Core's
    # convention), as one process with that train.micro_batch_size computes them. 1f1b and the
    # interleaved schedules need m >= pp; interleaved_1f1b / zero_bubble also m in [pp, 2 pp) or a
    # multiple of m // pp (train/run/layout.py refuses the rest before anything is built).
    microbatches: int | None = None
    ep: int = 1  # expert parallel, folded over dp_shard x cp
    # How MoE tokens reach experts on other ranks (tessera/parallel/expert_dispatch.py): "alltoall" sends
    # each routed row only to the rank owning its expert (traffic ~ routed rows; the default); "allgather"
    # gathers every token on every ep rank and reduce-scatters the outputs (simpler, more traffic; not with
    # moe.pad_to_capacity). Same numerics either way.
    ep_dispatcher: str = "alltoall"
    # The dtype the alltoall dispatcher sends its rows in (ep > 1): "input", the MoE input's (under bf16
    # autocast the fp32 residual stream); "compute", under autocast the autocast dtype (the experts' products
    # cast their input to it anyway, so the forward is unchanged; the rows' gradient crosses in it too,
    # rounded once), half the bytes. The combine sends the experts' outputs as they are. EP_DISPATCH_DTYPES.
    ep_dispatch_dtype: str = "input"
    cp: int = 1  # context parallel (sequence split across ranks for attention)
    # How attention sees the whole sequence under cp > 1 (tessera/parallel/context_parallel.py); all exact.
    # "alltoall" (Ulysses; the default): contiguous chunks, rank r holds chunk r; q, k, v are re-split from
    #   sequence to heads and back (two all-to-alls), balanced by construction. Needs cp | local query heads
    #   (model.n_heads / tp); where it does not divide, it falls back to the all-gather attention over the
    #   same contiguous chunks (exact, causally unbalanced: the last rank does the most work).
    # "allgather" (Llama 3): k, v gathered along the sequence; any head count.
    # "ring": k, v blocks passed around the cp ring, each transfer overlapped with the previous block's
    #   attention; exact log-sum-exp merge; memory of one block instead of the whole sequence.
    # allgather and ring use the balanced causal split (zig-zag / head-tail): each sequence is cut into
    # 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r, so 2 cp must divide train.seq_len.
    cp_method: str = "alltoall"
    # dp_shard always shards weights, gradients (reduce-scattered) and optimizer state through FSDP2;
    # zero_stage chooses when gathered weights are freed: 3 after each block's forward (least memory),
    # 1 and 2 after its backward (no second all-gather). The planner's ZeRO-1/2 rows are the textbook ones.
    zero_stage: int = 3
    # Who shards the optimizer state of data parallelism (one of OPTIMIZERS). "fsdp": FSDP2 shards weights,
    # gradients and AdamW state over dp_shard (zero_stage above). "distributed": Tessera's own ZeRO-1/2
    # distributed optimizer (tessera/parallel/distributed_optimizer.py, the idea of Megatron-Core's
    # DistributedOptimizer), no FSDP: weights replicated over dp_replicate x dp_shard x cp in the compute
    # dtype, gradients summed into contiguous fp32 buckets whose reduce-scatters start during backward as
    # each bucket completes, fp32 master weights and AdamW moments held only for this rank's shard of each
    # bucket, updated weights all-gathered per bucket and waited for by the first forward that uses them.
    # Composes with tp, sp, cp, ep (experts over their expert-data-parallel ranks) and pp (one per stage
    # part; there the reduce-scatters start after the schedule's backward). Not with fp16 or train.compile
    # (unset, it stays off; true is refused).
    optimizer: str = "fsdp"
    # parallel.optimizer=distributed: gradient bucket size in MiB of fp32 gradient. Smaller buckets start
    # their reduce-scatter earlier in backward (more overlap) but issue more, smaller collectives; 25 is
    # the size PyTorch DDP chose for the same trade. A parameter larger than a bucket gets its own.
    bucket_mb: float = 25.0
    recompute: str = "none"  # activation recomputation: one of RECOMPUTE_CHOICES
    recompute_interval: int = 1  # the policy applies to every k-th block (layer id % k == 0); the others keep all
    # recompute=op: the operators whose outputs are kept (RECOMPUTE_SAVE_CHOICES); the default is torchtitan's
    recompute_save: tuple[str, ...] = TORCHTITAN_SAVE
    # Saved activations of the blocks moved to pinned host memory in forward and back in backward (CUDA only:
    # on the CPU they are in host memory already). What recompute=op keeps stays on the GPU.
    activation_offload: bool = False
    # recompute=op: the kept outputs of these ACTIVATION_FP8_CHOICES are stored in FP8 (DeepSeek-V3 caches
    # activations in FP8, arXiv 2412.19437 section 3.3.3). Lossy: the backward multiplies the rounded values.
    activation_fp8: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.pp_schedule, self.vpp)

    def validate(self) -> None:
        for key in ("dp_replicate", "tp", "pp", "vpp", "ep", "cp", "recompute_interval"):
            v = getattr(self, key)
            if not isinstance(v, int) or not 1 <= v <= MAX_PARALLEL_SIZE:
                raise ConfigError(f"parallel.{key}={v!r} is invalid: must be an integer in 1..{MAX_PARALLEL_SIZE:,}")
        if (not isinstance(self.dp_shard, int) or self.dp_shard > MAX_PARALLEL_SIZE
                or (self.dp_shard < 1 and self.dp_shard != -1)):
            raise ConfigError(f"parallel.dp_shard={self.dp_shard!r} is invalid: must be in 1..{MAX_PARALLEL_SIZE:,} "
                              "or -1 (fill)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule!r} is invalid: one of {', '.join(PP_SCHEDULES)}")
        if self.vpp > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ConfigError(f"parallel.vpp={self.vpp} needs parallel.pp_schedule=interleaved_1f1b")
        if self.microbatches is not None and (not isinstance(self.microbatches, int)
                                              or not 1 <= self.microbatches <= MAX_PARALLEL_SIZE):
            raise ConfigError(f"parallel.microbatches={self.microbatches!r} is invalid: None or an integer in "
                              f"1..{MAX_PARALLEL_SIZE:,}")
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"parallel.zero_stage={self.zero_stage!r} is invalid: one of 1, 2, 3")
        if self.ep_dispatch_dtype not in EP_DISPATCH_DTYPES:
            raise ConfigError(f"parallel.ep_dispatch_dtype={self.ep_dispatch_dtype!r} is invalid: one of "
                              f"{', '.join(EP_DISPATCH_DTYPES)}")
        if self.ep_dispatcher not in EP_DISPATCHERS:
            raise ConfigError(f"parallel.ep_dispatcher={self.ep_dispatcher!r} is invalid: one of "
                              f"{', '.join(EP_DISPATCHERS)}")
        if self.cp_method not in CP_METHODS:
            raise ConfigError(f"parallel.cp_method={self.cp_method!r} is invalid: one of {', '.join(CP_METHODS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"parallel.optimizer={self.optimizer!r} is invalid: one of {', '.join(OPTIMIZERS)}")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) \
                or not 0 < self.bucket_mb <= 1024 * 1024:
            raise ConfigError(f"parallel.bucket_mb={self.bucket_mb!r} is invalid: a number of MiB in (0, 1048576]")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ConfigError(f"parallel.recompute={self.recompute!r} is invalid: one of "
                              f"{', '.join(RECOMPUTE_CHOICES)}")
        self._check_names("recompute_save", RECOMPUTE_SAVE_CHOICES)
        self._check_names("activation_fp8", ACTIVATION_FP8_CHOICES)
        if self.activation_fp8 and self.recompute != "op":
            raise ConfigError(f"parallel.activation_fp8={list(self.activation_fp8)} needs parallel.recompute=op: it "
                              f"stores the outputs that policy keeps in FP8 (now recompute={self.recompute})")
        if not isinstance(self.pp_overlap, bool):
            raise ConfigError(f"parallel.pp_overlap={self.pp_overlap!r} is invalid: true or false")
        if not isinstance(self.activation_offload, bool):
            raise ConfigError(f"parallel.activation_offload={self.activation_offload!r} is invalid: true or false")
        if self.sp and self.tp == 1:
            raise ConfigError("parallel.sp=true needs parallel.tp > 1 (sequence parallel lives inside tensor parallel)")

    def _check_names(self, key: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, key)
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"parallel.{key}={value!r} is invalid: a list of names from {', '.join(allowed)}")
        wrong = [v for v in value if v not in allowed]
        if wrong:
            raise ConfigError(f"parallel.{key} holds {', '.join(map(repr, wrong))}: allowed {', '.join(allowed)}")
        if len(set(value)) != len(value):
            raise ConfigError(f"parallel.{key}={list(value)} names an entry twice")
        setattr(self, key, tuple(value))

    def resolved_dp_shard(self, world_size: int) -> int:
        """dp_shard with -1 filled in from the world size; a size that does not divide is refused."""
        rest = self.dp_replicate * self.tp * self.pp * self.cp
        if self.dp_shard != -1:
            if rest * self.dp_shard != world_size:
                raise ConfigError(
                    f"parallel layout pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}"
                    f" x cp={self.cp} x tp={self.tp} = {rest * self.dp_shard} ranks, but the world has {world_size}"
                    " (start that many with --nproc N or torchrun, or change parallel.*)")
            return self.dp_shard
        if world_size % rest:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.pp x dp_replicate x cp x tp = {rest}"
                " (start more ranks with --nproc N or torchrun, or change parallel.*)")
        return world_size // rest
