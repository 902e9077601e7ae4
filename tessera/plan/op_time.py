"""Compute time of one micro-batch on one rank, operator by operator, from the operators' shapes.

Each matrix product [m, k] x [k, n] takes

    max(2 m n k / (peak x matmul_efficiency), bytes moved / HBM bandwidth) + KERNEL_OVERHEAD

so large GEMMs run at the GPU's sustained share of peak, small ones pay a fixed launch-and-tail
cost (3 us: a 1024^3 bf16 GEMM then lands near half of the large-GEMM rate, as cuBLAS measures on
A100/H100), and skinny ones (few rows per expert) are bound by reading their weights. A grouped
GEMM over the local experts is one kernel: the sum of its experts' roofline times plus one
overhead, with rows per expert = tokens x top-k x ep / experts (balanced routing).
The attention core runs at `attention_efficiency x s / (s + ATTENTION_HALF_SEQ)` of peak (fused
attention reaches its rate only at long sequences); a layout with `fused_attention=False` (runs
from before FlashAttention) pays batched GEMMs over the whole s x s matrix and memory-bound
passes over the scores instead. Norms, residual adds, RoPE and the SwiGLU
product are bound by memory: `Cluster.elementwise_passes` reads/writes of their tensors at HBM bandwidth,
at the width the activation dtype gives them (fp32 residual stream under autocast).

Backward is twice the forward (input and weight gradients, the 2:1 of the FLOP count), but for
the fused attention core: FlashAttention keeps no s x s matrix, so its backward computes the scores
q k^T again before the four products of the gradients (Dao 2023, arXiv 2307.08691, algorithm 2:
five products against the forward's two), 2.5 forwards (FUSED_ATTENTION_BACKWARD); full
recomputation adds one forward of the block, selective recomputation one forward of the core, the
operator-level policy the forward of what it does not keep: the products not kept (each at its
own shape), the attention core unless kept, and all elementwise work. Activation offload adds the
copies to host memory and back at the host link's bandwidth, on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.models.counting import attention_params
from tessera.models.flops import (
    attention_core_flops_per_token,
    attention_matmul_params,
    delta_rule_flops_per_token,
    ssd_flops_per_token,
)
from tessera.plan.activation_dtypes import get_activation_dtype
from tessera.plan.bubble import layer_replays
from tessera.plan.cluster import Cluster
from tessera.plan.layout import Layout, Workload
from tessera.plan.profile import ModelProfile, handoff_flops, layer_mixer
from tessera.plan.saved.recompute_terms import recomputed_products
from tessera.plan.saved.recurrent_terms import recurrent_chunks, recurrent_mixer_terms
from tessera.plan.saved.saved_terms import sdpa_core

KERNEL_OVERHEAD = 3e-6  # seconds per kernel: launch, first-wave ramp and last-wave tail
ATTENTION_HALF_SEQ = 512  # sequence length at which fused attention reaches half its long-sequence rate
ELEMENTWISE_PASSES = 2  # each elementwise tensor read once and written once (the profiles' Cluster.elementwise_passes)
BYTES = 2  # 16-bit operands for matrix products and elementwise work
FUSED_ATTENTION_BACKWARD = 2.5  # backward / forward work of a fused attention core (module docstring)
RECURRENT_KERNELS_PER_CHUNK = 4  # a chunk step's products and state update (delta_rule.py's _chunk_step, ssd.py's)
UNFUSED_SCORE_PASSES = 5  # softmax (read + write), dropout (read, write, 1-byte mask) over the s x s scores


def gemm_time(m: float, n: float, k: float, cluster: Cluster, batch: float = 1.0) -> float:
    """Seconds of `batch` products [m, k] x [k, n] in one kernel (a grouped GEMM when batch > 1)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    moved = BYTES * (m * k + k * n + m * n) * batch
    return max(flops / (cluster.gpu_flops * cluster.efficiency), moved / cluster.memory_bandwidth) + KERNEL_OVERHEAD


def attention_rate(cluster: Cluster, seq_len: int) -> float:
    """FLOP/s of the fused attention core at this sequence length."""
    return cluster.gpu_flops * cluster.attention_efficiency * seq_len / (seq_len + ATTENTION_HALF_SEQ)


@dataclass(frozen=True)
class LayerTime:
    """Forward seconds of one layer on one rank for one micro-batch, by kind of work."""

    matmul: float  # projections, MLP / experts, router
    attention: float  # the attention core
    memory: float  # elementwise, bound by HBM bandwidth

    @property
    def forward(self) -> float:
        return self.matmul + self.attention + self.memory


@dataclass(frozen=True)
class OpTime:
    """One operator of a layer's forward on one rank: what it is, its shape, FLOPs and seconds."""

    name: str
    kind: str  # matmul, attention or memory (elementwise)
    shape: str
    flops: float
    seconds: float


def _gemm(name: str, m: float, n: float, k: float, cluster: Cluster, batch: float = 1.0) -> OpTime:
    shape = f"[{m:.0f} x {k:.0f}] x [{k:.0f} x {n:.0f}]" + (f" x {batch:.0f}" if batch > 1 else "")
    return OpTime(name, "matmul", shape, 2.0 * m * n * k * batch, gemm_time(m, n, k, cluster, batch))


def _swiglu(name: str, tokens: float, ffn: float, h: int, cluster: Cluster, batch: float = 1.0,
            relu2: bool = False) -> list[OpTime]:
    """SwiGLU's gate and up (one product of twice the width) and down; `relu2`: the ungated up and down."""
    return [_gemm(f"{name} up" if relu2 else f"{name} gate+up", tokens, (1 if relu2 else 2) * ffn, h, cluster, batch),
            _gemm(f"{name} down", tokens, h, ffn, cluster, batch)]


def recurrent_ops(cfg: ModelConfig, layer: int, lay: Layout, tokens: float, seq_len: int, cluster: Cluster,
                  dtype: str) -> list[OpTime]:
    """A recurrent mixer's forward (Gated DeltaNet, Kimi delta attention, Mamba-2) on one rank: its
    projections as one product of its own weights, and its chunked core at its own FLOPs
    (models/flops.py) and bytes (what it writes for backward, saved/recurrent_terms.py): the slower of the two
    rooflines, plus a few kernels per chunk, which run one after another (the state passes between them)."""
    tp, h = lay.tp, cfg.dim
    mixer = layer_mixer(cfg, layer)
    core = delta_rule_flops_per_token(cfg, seq_len) if mixer == "delta" else ssd_flops_per_token(cfg, seq_len)
    flops = core * tokens / tp
    batch = max(int(tokens // seq_len), 1)
    written = sum(t.nbytes(tokens, tp) for t in recurrent_mixer_terms(
        cfg, layer, get_activation_dtype(dtype), max(int(tokens), 1), batch, tp))
    chunks = recurrent_chunks(cfg, layer, seq_len)
    seconds = max(flops / (cluster.gpu_flops * cluster.efficiency), written / cluster.memory_bandwidth)
    name = "Mamba-2 (chunked SSD)" if mixer == "ssd" else "delta rule (chunked)"
    return [_gemm(f"{name} projections", tokens, attention_matmul_params(cfg, layer) / h / tp, h, cluster),
            OpTime(f"{name} core", "matmul", f"{chunks} chunks, {written / 1e9:.2f} GB written", flops,
                   seconds + RECURRENT_KERNELS_PER_CHUNK * chunks * KERNEL_OVERHEAD)]


def layer_ops(cfg: ModelConfig, moe: bool, lay: Layout, tokens: float, seq_len: int, cluster: Cluster,
              dtype: str = "bf16", layer: int | None = None) -> list[OpTime]:
    """The operators of one decoder layer's forward (dense or MoE) on `tokens` tokens of one rank;
    `layer` (a layer of that kind): a hybrid's recurrent mixer priced as itself (`recurrent_ops`), a
    one-sublayer layer (Nemotron-H) with its one sublayer only. `dtype` is the activation dtype: under
    autocast the residual stream, its norms and RoPE run in fp32 (4 bytes per element), the rest in bf16."""
    mixer = "attention" if layer is None else layer_mixer(cfg, layer)
    if layer is not None and (mixer != "attention" or cfg.sublayers is not None):
        return _hybrid_layer_ops(cfg, moe, lay, tokens, seq_len, cluster, dtype, layer)
    tp, h = lay.tp, cfg.dim
    dt = get_activation_dtype(dtype)
    if cfg.mla is not None:  # latent down/up projections: one product of the same FLOPs per token
        ops = [_gemm("attention projections (MLA)", tokens, attention_params(cfg) / h / tp, h, cluster)]
    else:
        q, kv = cfg.n_heads * cfg.head_dim / tp, cfg.n_kv_heads * cfg.head_dim / tp
        ops = [_gemm("q, k, v projection", tokens, q + 2 * kv, h, cluster), _gemm("output projection", tokens, h, q,
                                                                                   cluster)]
    # Elementwise bytes per token: two norms (read + write) and two residual adds (2 reads + write) on
    # the residual stream, RoPE on q and k, then the MLP's products at the compute width.
    moved = 10 * h / (tp if lay.sp else 1) * dt.residual
    if cfg.mla is None:
        moved += 2 * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim / tp * max(dt.compute, dt.residual)
    elementwise = 0.0  # elements at the compute width
    if moe:
        e = cfg.moe
        ops.append(_gemm("router", tokens, e.num_experts, h, cluster))
        local = e.num_experts // lay.ep
        rows = tokens * e.top_k * lay.ep / e.num_experts  # rows per expert, balanced routing
        relu2 = e.expert_activation == "relu2"  # Nemotron-H's relu^2 experts and shared expert: up and down
        ops += _swiglu(f"experts (grouped, {local} local)", rows, e.ffn_dim / tp, h, cluster, local, relu2)
        if e.shared_ffn_dim:
            ops += _swiglu("shared expert", tokens, e.shared_ffn_dim / tp, h, cluster, relu2=relu2)
    else:
        ops += _swiglu("MLP", tokens, cfg.ffn_dim / tp, h, cluster)
    elementwise += _mlp_elementwise(cfg, moe, tp)  # the SwiGLU (or relu^2) product; the MoE's gather + weighted sum
    if lay.fused_attention:
        flops = attention_core_flops_per_token(cfg, seq_len) * tokens / tp
        ops.append(OpTime("attention core (fused)", "attention", f"{cfg.n_heads // tp} heads x {seq_len} keys", flops,
                          flops / attention_rate(cluster, seq_len)))
    else:
        heads = tokens / seq_len * cfg.n_heads / tp
        d = cfg.head_dim if cfg.mla is None else cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
        ops.append(OpTime("attention core (unfused)", "attention", f"{heads:.0f} x [{seq_len} x {seq_len}]",
                          4.0 * heads * seq_len * seq_len * d, unfused_attention_time(cfg, tokens / seq_len, seq_len,
                                                                                      tp, cluster)))
    moved = cluster.elementwise_passes * (moved + dt.compute * elementwise) * tokens
    ops.append(OpTime("norms, residuals, RoPE, SwiGLU product", "memory", f"{moved / 1e9:.2f} GB moved", 0.0,
                      moved / cluster.memory_bandwidth))
    return ops


def _hybrid_layer_ops(cfg: ModelConfig, moe: bool, lay: Layout, tokens: float, seq_len: int, cluster: Cluster,
                      dtype: str, layer: int) -> list[OpTime]:
    """A hybrid's layer: a recurrent mixer and its MLP or MoE, or Nemotron-H's one sublayer (a norm and a
    residual add, then a mixer, an ungated relu^2 MLP or an MoE layer); the attention, MLP and MoE
    products as an attention layer of the same kind has them."""
    sub = None if cfg.sublayers is None else cfg.sublayers[layer]
    mixer, dt, h, tp = layer_mixer(cfg, layer), get_activation_dtype(dtype), cfg.dim, lay.tp
    attention_parts = ("q, k, v", "output projection", "attention")
    full = layer_ops(cfg, moe, lay, tokens, seq_len, cluster, dtype)
    ops = recurrent_ops(cfg, layer, lay, tokens, seq_len, cluster, dtype) if mixer in ("delta", "ssd") else []
    moved = (5 if sub is not None else 10) * h / (tp if lay.sp else 1) * dt.residual  # norms and residual adds
    if sub == "attention":
        ops += [o for o in full if o.name.startswith(attention_parts)]
        moved += 2 * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim / tp * max(dt.compute, dt.residual)
    elif sub == "mlp":  # relu^2: up, down, and relu and its square over the hidden rows
        f = cfg.ffn_dim / tp
        ops += [_gemm("MLP up", tokens, f, h, cluster), _gemm("MLP down", tokens, h, f, cluster)]
        moved += 2 * f * dt.compute
    elif sub in (None, "moe"):  # a recurrent mixer's MLP or MoE, or an MoE sublayer
        ops += [o for o in full if not o.name.startswith((*attention_parts, "norms"))]
        moved += _mlp_elementwise(cfg, moe, tp) * dt.compute
    moved *= cluster.elementwise_passes * tokens
    ops.append(OpTime("norms, residuals, gates", "memory", f"{moved / 1e9:.2f} GB moved", 0.0,
                      moved / cluster.memory_bandwidth))
    return ops


def _mlp_elementwise(cfg: ModelConfig, moe: bool, tp: int) -> float:
    """Elements per token the MLP's (or MoE's) elementwise work moves at the compute width (as `layer_ops`):
    three per hidden unit of a SwiGLU, two of relu^2 (relu and its square: Nemotron-H's experts)."""
    if not moe:
        return 3 * cfg.ffn_dim / tp
    e = cfg.moe
    per = 2 if e.expert_activation == "relu2" else 3
    return per * e.top_k * e.ffn_dim / tp + 2 * e.top_k * cfg.dim + (per * e.shared_ffn_dim / tp if e.shared_ffn_dim
                                                                     else 0)


def layer_time(cfg: ModelConfig, moe: bool, lay: Layout, tokens: float, seq_len: int,
               cluster: Cluster, dtype: str = "bf16", layer: int | None = None) -> LayerTime:
    """Forward time of one decoder layer (dense or MoE; `layer`: one of its kind, `layer_ops`) on `tokens`
    tokens of one rank, by kind."""
    ops = layer_ops(cfg, moe, lay, tokens, seq_len, cluster, dtype, layer)
    return LayerTime(**{kind: sum(o.seconds for o in ops if o.kind == kind) for kind in ("matmul", "attention",
                                                                                         "memory")})


def unfused_attention_time(cfg: ModelConfig, sequences: float, seq_len: int, tp: int, cluster: Cluster) -> float:
    """Forward of attention without a fused kernel (Megatron-LM before FlashAttention): q k^T and
    p v as batched GEMMs over the whole s x s matrix (causal masking skips nothing), and the
    scores' scale + mask + softmax and dropout as UNFUSED_SCORE_PASSES memory-bound passes."""
    heads = sequences * cfg.n_heads / tp
    d = cfg.head_dim if cfg.mla is None else cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    gemms = 2 * gemm_time(seq_len, seq_len, d, cluster, batch=heads)
    scores = UNFUSED_SCORE_PASSES * BYTES * heads * seq_len * seq_len / cluster.memory_bandwidth
    return gemms + scores


def head_time(cfg: ModelConfig, lay: Layout, tokens: float, cluster: Cluster) -> float:
    """Forward time of the final norm, LM head and the loss's softmax on one rank."""
    vocab = cfg.vocab_size / lay.tp
    softmax = cluster.elementwise_passes * 4 * vocab * tokens / cluster.memory_bandwidth  # fp32 logits
    return gemm_time(tokens, vocab, cfg.dim, cluster) + softmax


def op_recompute_time(cfg: ModelConfig, moe: bool, lay: Layout, tokens: float, seq_len: int, cluster: Cluster,
                      dtype: str, forward: LayerTime, layer: int | None = None) -> LayerTime:
    """What `recompute=op` re-runs of one layer in backward: its products not kept (saved/recompute_terms.py),
    the attention core unless kept (a recurrent mixer's chunked core always), and the layer's elementwise work."""
    layer = next(i for i in range(cfg.n_layers) if cfg.is_moe_layer(i) == moe) if layer is None else layer
    local = cfg.moe.num_experts // lay.ep if cfg.moe is not None else None
    products = recomputed_products(cfg, layer, dtype, lay.recompute_save, lay.activation_fp8,
                                   tokens=max(int(tokens), 1), local_experts=local)
    matmul = 0.0
    for p in products:
        n = p.n / lay.tp if p.split == "tp" else p.n
        k = p.k / lay.tp if p.role in ("attention_out", "mlp_out") else p.k
        matmul += gemm_time(p.rows * tokens / p.batch, n, k, cluster, batch=p.batch)
    if layer_mixer(cfg, layer) in ("delta", "ssd"):  # a recurrent core re-runs whatever the save list
        matmul += sum(o.seconds for o in recurrent_ops(cfg, layer, lay, tokens, seq_len, cluster, dtype)
                      if o.name.endswith(" core"))
    core_kept = "attention_core" in lay.recompute_save and not (lay.cp > 1 and lay.cp_method == "ring") \
        and sdpa_core(cfg, layer)  # (a core with sinks is products of its own: it re-runs)
    return LayerTime(matmul=matmul, attention=0.0 if core_kept else forward.attention, memory=forward.memory)


def recompute_time(cfg: ModelConfig, moe: bool, lay: Layout, tokens: float, seq_len: int, cluster: Cluster,
                   dtype: str, forward: LayerTime, layer: int | None = None) -> LayerTime:
    """Forward work one layer (of `layer`'s kind) to which the recomputation policy applies runs again in
    backward."""
    if lay.recompute == "full":
        return forward
    if lay.recompute == "selective":
        return LayerTime(matmul=0.0, attention=forward.attention, memory=0.0)
    if lay.recompute == "op":
        return op_recompute_time(cfg, moe, lay, tokens, seq_len, cluster, dtype, forward, layer)
    return LayerTime(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class StageCompute:
    """Seconds of one micro-batch's forward + backward (+ recomputation, + offload copies) on one rank
    of a stage."""

    matmul: float
    attention: float
    memory: float
    transfer: float = 0.0  # activation offload: to host memory and back

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.memory + self.transfer


def stage_compute_time(cfg: ModelConfig, lay: Layout, work: Workload, stage: int, cluster: Cluster,
                       profile: ModelProfile, dtype: str = "bf16", offloaded: float = 0.0) -> StageCompute:
    """Forward x 3 (forward, input and weight gradients; the fused attention core x 3.5) of every
    layer of the stage, plus what recomputation repeats, plus the LM head on the last stage, plus
    moving `offloaded` bytes (one micro-batch's activations offloaded to host memory) there and back."""
    tokens = work.micro_batch * work.seq_len / lay.cp
    key = ("layer_time", lay.tp, lay.sp, lay.ep, lay.cp, lay.cp_method, lay.fused_attention, work.micro_batch,
           cluster, dtype, lay.recompute, lay.recompute_save, lay.activation_fp8)

    def kind_times(kind: int) -> tuple[LayerTime, LayerTime]:  # kind: the first layer of a `layer_kind`
        moe = profile.moe[kind]
        t = layer_time(cfg, moe, lay, tokens, work.seq_len, cluster, dtype, kind)
        return t, recompute_time(cfg, moe, lay, tokens, work.seq_len, cluster, dtype, t, kind)

    times = profile.memo(key, lambda: {kind: kind_times(kind) for kind in set(profile.kinds)})
    matmul = attention = memory = 0.0
    attention_passes = 1 + (FUSED_ATTENTION_BACKWARD if lay.fused_attention else 2)
    more = more_replays(cfg, lay, work, stage, profile)
    for (kind, applies), n in profile.stage_layer_kinds(lay.pp, lay.vpp, stage, lay.recompute,
                                                        lay.recompute_interval).items():
        t, again = times[kind]
        replays = n + more.get(kind, 0.0) if applies else 0.0
        matmul += n * 3 * t.matmul + replays * again.matmul
        memory += n * 3 * t.memory + replays * again.memory
        attention += n * attention_passes * t.attention + replays * again.attention
    if stage == lay.pp - 1:
        matmul += 3 * head_time(cfg, lay, tokens, cluster)
    matmul += handoff_time(cfg, lay, work, stage, cluster, profile)
    return StageCompute(matmul=matmul, attention=attention, memory=memory,
                        transfer=2 * offloaded / cluster.host_bandwidth if offloaded else 0.0)


def more_replays(cfg: ModelConfig, lay: Layout, work: Workload, stage: int, profile: ModelProfile
                 ) -> dict[int, float]:
    """Replays per micro-batch beyond one of the recomputed layers (by their kind's first layer) pipeline
    rank `stage` holds as the trainer places them (bubble.py's `layer_replays`: a split backward's weight
    pass replays a recomputed block once per weight group)."""
    m = lay.microbatches(work)
    def count() -> dict[int, float]:
        out: dict[int, float] = {}
        replays = layer_replays(cfg, lay.pp_schedule, lay.pp, m, lay.recompute, lay.vpp)
        for i, (rank, r) in enumerate(replays):
            if rank == stage and i % lay.recompute_interval == 0 and r > 1:
                out[profile.kinds[i]] = out.get(profile.kinds[i], 0.0) + r - 1
        return out

    return profile.memo(("more_replays_by_kind", lay.pp_schedule, lay.pp, lay.vpp, m, lay.recompute,
                         lay.recompute_interval, stage), count)


def handoff_time(cfg: ModelConfig, lay: Layout, work: Workload, stage: int, cluster: Cluster,
                 profile: ModelProfile) -> float:
    """What context parallelism adds to the stage's recurrent layers' products (`handoff_flops`), forward,
    input and weight gradients' share (x 3), and again where full or op recomputation re-runs the layer."""
    if lay.cp == 1:
        return 0.0
    flops = 0.0
    for (mixer, applies), n in profile.stage_mixers(lay.pp, lay.vpp, stage, lay.recompute,
                                                   lay.recompute_interval).items():
        if mixer in ("delta", "ssd"):
            again = 1 if applies and lay.recompute in ("full", "op") else 0
            flops += n * (3 + again) * handoff_flops(cfg, mixer, lay, work.micro_batch, work.seq_len)
    return flops / (cluster.gpu_flops * cluster.efficiency)
