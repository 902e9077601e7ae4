"""Model-state memory per rank: weights, gradients, fp32 master weights and optimizer state.

Mixed-precision Adam holds, per parameter, a compute copy of the weight, its gradient, an fp32
master copy and two fp32 moments (Rajbhandari et al. 2019, ZeRO, arXiv 1910.02054, section 3.1:
2 + 2 + 12 = 16 bytes). ZeRO shards them over the d data-parallel ranks in stages:
stage 1 the optimizer state and master weights (4N + 12N/d), stage 2 also the gradients
(2N + 14N/d), stage 3 also the weights (16N/d). Here d is dp_shard x cp for dense weights and
dp_shard x cp / ep for experts; dp_replicate copies everything (hybrid sharding).

What is counted: parameters only (buffers such as RoPE tables and expert biases are not; they are
kilobytes), and the AdamW moments `exp_avg` and `exp_avg_sq`; AdamW's per-tensor `step` counter
(one 4-byte scalar per parameter tensor) is left out. Under ZeRO-3 the layer being computed and
the next one are gathered unsharded (FSDP's prefetch), and one layer's unsharded gradient waits
for its reduce-scatter: `gathered` counts those buffers.

Gradient accumulation changes this, as the trainer runs it: gradients are reduce-scattered once
per step (FSDP2 `set_requires_gradient_sync` off until the last micro-batch), so until then every
sharded parameter keeps its whole, unsharded gradient; with m > 1 micro-batches the gradients
are not divided by the shard count. Under pipeline parallelism torch's schedules also keep the
gathered weights until the step's last backward (`set_reshard_after_backward(False)`), so a stage
holds all its weights unsharded besides its shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from tessera.config.choices import lookup_choice
from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.models.counting import block_norm_params, indexer_params, layer_params, mamba_params, qk_norm_params
from tessera.plan.activation_dtypes import get_activation_dtype
from tessera.plan.activations import StageActivations
from tessera.plan.layout import Layout, Workload
from tessera.plan.profile import ModelProfile


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state."""

    name: str
    weight_bytes: int  # the copy the forward pass multiplies with
    grad_bytes: int  # the gradient kept between backward and the optimizer step
    master_bytes: int  # fp32 master weights (0 when the weights are fp32 already)
    optimizer_bytes: int  # AdamW: exp_avg + exp_avg_sq in fp32

    @property
    def total(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


PRECISIONS = {
    # fp32 training: the weights are their own master copy.
    "fp32": Precision("fp32", 4, 4, 0, 8),
    # bf16 compute over fp32 master weights, fp32 gradients (Megatron's accounting: 18 bytes, and
    # 6 + 12/d with its distributed optimizer). Also what autocast or FSDP2 with an fp32
    # reduce dtype keep: an fp32 parameter, its fp32 gradient and a transient bf16 copy.
    "bf16": Precision("bf16", 2, 4, 4, 8),
    # The ZeRO paper's mixed precision: 16-bit weights and gradients, K = 12 bytes of fp32 state.
    "bf16-lowp-grads": Precision("bf16-lowp-grads", 2, 2, 4, 8),
    # DeepSeek-V3 (arXiv 2412.19437, section 3.3.3): AdamW moments in bf16, fp32 master weights and
    # gradients. A planner precision: Tessera's optimizer keeps fp32 moments.
    "bf16-lowp-moments": Precision("bf16-lowp-moments", 2, 4, 4, 4),
}


def get_precision(name: str) -> Precision:
    return lookup_choice(PRECISIONS, name, "precision")


@dataclass(frozen=True)
class ModelStateBytes:
    weights: float
    gradients: float
    master: float
    optimizer: float
    gathered: float = 0.0  # ZeRO-3 transient unsharded buffers

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"total": self.total}


def zero_model_state_bytes(n_params: float, dp: int, stage: int, precision: Precision) -> ModelStateBytes:
    """Per-rank model states of `n_params` parameters under ZeRO `stage` (0-3) over `dp` ranks.

    The formulas of Rajbhandari et al. 2019, figure 1 (stage 0 is plain data parallelism)."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero stage={stage!r} is invalid: one of 0, 1, 2, 3")
    n, p = float(n_params), precision
    shard_opt = dp if stage >= 1 else 1
    shard_grad = dp if stage >= 2 else 1
    shard_w = dp if stage >= 3 else 1
    return ModelStateBytes(weights=n * p.weight_bytes / shard_w, gradients=n * p.grad_bytes / shard_grad,
                           master=n * p.master_bytes / shard_opt, optimizer=n * p.optimizer_bytes / shard_opt)


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank of a pipeline stage holds before ZeRO sharding: `dense` (cut by tp)
    and `expert` (split by ep, cut by tp); `largest_unit` is the biggest FSDP unit (one layer, the
    embedding or the head) in the same sense, for the ZeRO-3 gather buffers."""

    dense: float
    expert: float
    largest_unit: float
    # The FSDP units (tessera.parallel.data_parallel), for the data-parallel collectives:
    root: float = 0.0  # dense parameters outside the blocks: embedding, final norm, head
    blocks: int = 0  # decoder layers on this rank (one unit each)
    moe_blocks: int = 0  # ... of which MoE layers (their experts are a unit of their own when ep > 1)
    router: float = 0.0  # router weights of those layers (a unit of their own under low-precision params)

    @property
    def total(self) -> float:
        return self.dense + self.expert


def _mixer_replicated(cfg: ModelConfig, layer: int) -> float:
    """Parameters of layer `layer`'s token mixer that every tp rank holds whole, as the trainer's tensor-parallel
    plans leave them (tessera/parallel/tensor_parallel.py): the low-rank down-projections, their norms and
    sparse attention's indexer (MLA); the QK norms and the output bias (GQA); a Gated DeltaNet's convolution,
    A_log, dt_bias and gated norm, and Qwen3.5's whole in_proj_qkv; a Kimi delta attention's convolutions,
    decay and gate down-projections, dt_bias, A_log and norm; everything of a Mamba-2 mixer but out_proj's weight."""
    h = cfg.dim
    if cfg.sublayers is not None and cfg.sublayers[layer] in ("mlp", "moe"):
        return 0.0
    if cfg.is_linear_attention_layer(layer):
        la = cfg.linear_attention
        if la.kind == "kda":
            hk, k = la.n_key_heads * la.key_head_dim, la.key_head_dim
            return 3 * hk * la.conv_width + hk + la.n_key_heads + k + 2 * h * k
        keys, values = la.n_key_heads * la.key_head_dim, la.n_value_heads * la.value_head_dim
        channels = 2 * keys + values
        whole_qkv = h * channels if la.projections == "split" else 0
        return channels * la.conv_width + 2 * la.n_value_heads + la.value_head_dim + whole_qkv
    if cfg.is_mamba_layer(layer):
        return mamba_params(cfg) - cfg.mamba.n_heads * cfg.mamba.head_dim * h
    if cfg.mla is not None:
        m = cfg.mla
        rep = h * m.q_lora_rank + m.q_lora_rank if m.q_lora_rank is not None else 0
        return rep + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + indexer_params(cfg)
    return (h if cfg.out_bias else 0) + qk_norm_params(cfg)


def routed_expert_params(cfg: ModelConfig, layer: int) -> float:
    """The routed experts' parameters of layer `layer` (0 where it has none): what expert parallelism splits."""
    if not cfg.is_moe_layer(layer) or (cfg.sublayers is not None and cfg.sublayers[layer] != "moe"):
        return 0.0
    e = cfg.moe
    mats = 2 if e.expert_activation == "relu2" else 3
    biases = 2 * e.ffn_dim + cfg.dim if e.expert_activation == "clamped_swiglu" else 0
    return e.num_experts * (mats * cfg.dim * e.ffn_dim + biases)


def layer_rank_params(cfg: ModelConfig, layer: int, tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters of decoder layer `layer` on one rank: the layer's own count
    (tessera.models.counting, whatever its mixer), its routed experts split over ep and cut by tp, the rest cut
    by tp but for what stays whole (the norms, the router, a shared expert's gate, `_mixer_replicated`)."""
    h = cfg.dim
    expert = routed_expert_params(cfg, layer)
    rep = (h if cfg.sublayers is not None else block_norm_params(cfg)) + _mixer_replicated(cfg, layer)
    if cfg.is_moe_layer(layer) and (cfg.sublayers is None or cfg.sublayers[layer] == "moe"):
        e = cfg.moe
        rep += e.num_experts * h + (e.num_experts if e.router_bias else 0) + (h if e.shared_expert_gate else 0)
    dense = rep + (layer_params(cfg, layer) - expert - rep) / tp
    return dense, expert / (ep * tp)


def rank_params(cfg: ModelConfig, lay: Layout, profile: ModelProfile | None = None) -> list[RankParams]:
    """Parameters on one rank of each pipeline stage (first stage: embedding; last: norm + head;
    with tied embeddings and pp > 1 both ends hold the shared matrix)."""
    prof = profile or ModelProfile.of(cfg, cfg.max_seq_len)
    out = []
    vocab = cfg.vocab_size * cfg.dim / lay.tp
    for s in range(lay.pp):
        dense = expert = largest = root = 0.0
        blocks = moe_blocks = 0
        for (kind, _), n in prof.stage_layer_kinds(lay.pp, lay.vpp, s, "none", 1).items():
            d, x = prof.memo(("layer_params", kind, lay.tp, lay.ep),
                             lambda kind=kind: layer_rank_params(cfg, kind, lay.tp, lay.ep))
            dense, expert, largest = dense + n * d, expert + n * x, max(largest, d + x)
            blocks, moe_blocks = blocks + n, moe_blocks + (n if prof.moe[kind] else 0)
        if s == 0:
            root += vocab
            largest = max(largest, vocab)
        if s == lay.pp - 1:
            root += cfg.dim
            if not cfg.tie_embeddings or lay.pp > 1:
                root += vocab
                largest = max(largest, vocab)
        router = moe_blocks * cfg.moe.num_experts * cfg.dim if moe_blocks else 0.0
        out.append(RankParams(dense=dense + root, expert=expert, largest_unit=largest, root=root, blocks=blocks,
                              moe_blocks=moe_blocks, router=router))
    return out


def model_state_bytes(params: RankParams, lay: Layout, precision: Precision, microbatches: int = 1
                      ) -> ModelStateBytes:
    """Model states of one rank: dense parameters sharded over dp_shard x cp, experts over
    dp_shard x cp / ep, each by ZeRO stage `lay.zero_stage`; with `microbatches` > 1 the
    gradients are held unsharded until the step's last micro-batch (module docstring)."""
    if lay.optimizer == "distributed":
        return distributed_optimizer_state_bytes(params, lay, precision)
    accumulating = microbatches > 1
    states = []
    for n, shard in ((params.dense, lay.dense_shard), (params.expert, lay.expert_shard)):
        st = zero_model_state_bytes(n, shard, lay.zero_stage, precision)
        if accumulating and shard > 1:
            st = dataclasses.replace(st, gradients=n * precision.grad_bytes)
        states.append(st)
    dense, expert = states
    sharded = lay.dense_shard > 1 or lay.expert_shard > 1
    gathered = 0.0
    if lay.zero_stage == 3 and sharded:
        gathered = params.largest_unit * (2 * precision.weight_bytes + precision.grad_bytes)
    if lay.pp > 1 and accumulating and sharded:  # gathered weights stay until the last backward
        kept = sum(n * precision.weight_bytes for n, shard in ((params.dense, lay.dense_shard),
                                                                (params.expert, lay.expert_shard)) if shard > 1)
        gathered = max(gathered, kept + params.largest_unit * precision.weight_bytes)
    return ModelStateBytes(weights=dense.weights + expert.weights, gradients=dense.gradients + expert.gradients,
                           master=dense.master + expert.master, optimizer=dense.optimizer + expert.optimizer,
                           gathered=gathered)


def teacher_weight_bytes(teacher: ModelConfig, lay: Layout, precision: Precision, stage: int = 0) -> float:
    """Weights of a distillation teacher (`train.distill.teacher`) on one rank of pipeline stage
    `stage`: cut by the student's layout (tp, ep; under pp its layers split over the same stages:
    tessera.parallel.pipeline_companion), sharded like the student's weights (dp_shard x cp under
    ZeRO-3, whole under the distributed optimizer), in the compute copy's bytes; frozen, so no
    gradients, master weights or optimizer state."""
    params = rank_params(teacher, lay)[stage]
    if lay.optimizer == "distributed":
        return params.total * precision.weight_bytes
    return sum(zero_model_state_bytes(n, shard, lay.zero_stage, precision).weights
               for n, shard in ((params.dense, lay.dense_shard), (params.expert, lay.expert_shard)))


def teacher_stage_bytes(teacher: ModelConfig, lay: Layout, work: Workload, precision: Precision,
                        activation_dtype: str, stage: int, activations: StageActivations) -> float:
    """What a distillation teacher adds to one rank of pipeline stage `stage`: its weights
    (`teacher_weight_bytes`) and, on every stage but the first, its hidden states received beside
    the student's (tessera.parallel.pipeline_companion): kept with the stage input until the
    micro-batch's backward, so one [micro-batch, seq / cp, teacher dim] tensor in the residual
    stream's dtype per micro-batch in flight."""
    weights = teacher_weight_bytes(teacher, lay, precision, stage)
    if stage == 0:
        return weights
    residual = get_activation_dtype(activation_dtype).residual
    per_microbatch = work.micro_batch * work.seq_len / lay.cp * teacher.dim * residual
    return weights + activations.in_flight * per_microbatch


def distributed_optimizer_state_bytes(params: RankParams, lay: Layout, precision: Precision) -> ModelStateBytes:
    """`parallel.optimizer=distributed` (tessera/parallel/distributed_optimizer.py, the idea of
    Megatron-Core's distributed optimizer): the compute copy of every weight and the whole gradient
    buffers on every rank, fp32 master weights and AdamW moments only for this rank's shard over the
    data-parallel ranks (dp_replicate x dp_shard x cp for dense weights, / ep for experts): Megatron's
    6 + 12/d bytes per parameter in bf16."""
    p, total = precision, params.dense + params.expert
    dense_d, expert_d = lay.dp_replicate * lay.dense_shard, lay.dp_replicate * lay.expert_shard
    sharded = params.dense / dense_d + params.expert / expert_d
    return ModelStateBytes(weights=total * p.weight_bytes, gradients=total * p.grad_bytes,
                           master=sharded * p.master_bytes, optimizer=sharded * p.optimizer_bytes)


def sharding_choices(params: RankParams, lay: Layout, precision: Precision, microbatches: int = 1
                     ) -> dict[str, ModelStateBytes]:
    """Model states of one rank under each data-parallel choice for the same ranks: everything
    replicated (plain data parallelism: what dp_replicate does), then ZeRO-1, 2 and 3 over
    dp_shard x cp (dp_shard x cp / ep for experts)."""
    out = {"replicated": zero_model_state_bytes(params.total, 1, 0, precision)}
    fsdp = dataclasses.replace(lay, optimizer="fsdp")
    for stage in (1, 2, 3):
        out[f"zero{stage}"] = model_state_bytes(params, dataclasses.replace(fsdp, zero_stage=stage), precision,
                                                microbatches)
    out["distributed"] = distributed_optimizer_state_bytes(params, lay, precision)
    return out
