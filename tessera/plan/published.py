"""Published training runs the planner is checked against (`tessera plan validate`), for time and memory.

Each run records its source, model, GPUs, layout, batch, sequence length, the published figure,
and whether it is a calibration run (the time model's per-GPU constants were chosen with it in
view) or held out (nothing was chosen on it). Memory is checked for every run: against the
per-GPU memory the source reports where it reports one, and against the memory of the GPUs it
ran on (the planned peak must fit them). No memory constant is fitted to any run (the activation
bytes are the trainer's saved tensors, tests/plan; the 3 GiB reserve is the planner's default).
`plan_run(run)` plans it with the GPU's preset and the run's efficiency profile (the same
constants for every run of that GPU: no per-run factors).

Calibration runs (time):
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198), Megatron-LM on Selene (DGX A100 80GB, 8 per node, 8 x 200 Gb/s HDR per node).
  GPT models (GeLU MLP of 4h, multi-head attention, vocabulary 51,200, sequence 2,048, micro-batch
  1, no data parallelism); table 3 gives the layouts, table 5 the seconds per iteration with
  sequence parallelism + selective recomputation ("present work") and with tensor parallelism and
  full recomputation. Attention was not fused (the paper predates FlashAttention in Megatron-LM:
  its selective recomputation exists to avoid storing the s x s scores). The 4h GeLU MLP is
  written as a SwiGLU of ffn = 8h/3 (the same weights and FLOPs per token), rounded down to a
  multiple of 8 where 8h/3 is not whole (530B, 1T: -0.01%). Memory: they ran on 80 GB A100s.
- Llama Team 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), table 4: Llama 3 405B (126
  layers, h 16,384, 128 heads / 8 KV heads, FFN 53,248, vocabulary 128,256) at sequence 8,192 and
  16M tokens per batch on H100 with TP8, CP1, PP16: 430 TFLOP/s per GPU on 8,192 GPUs (DP 64) and
  400 on 16,384 (DP 128); BF16. The paper runs an interleaved pipeline schedule (section 3.3.2;
  virtual stages are not given: we assume v = 2) and FSDP that does not reshard after the forward
  (weights gathered once per step, gradients reduce-scattered once per step: zero_stage 1 here).
  The predicted TFLOP/s counts model FLOPs as `tessera.models.flops` does (causal attention as
  half the score matrix); the paper does not say its convention (counting the whole matrix would
  add about 4% to both the prediction and, if so counted, the figure). Memory: section 3.3.1, H100s
  "with 80GB HBM3"; the paper does not say which activation recomputation ran: planned with none.
- DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv 2412.19437): 2,048 H800 GPUs, PP16,
  EP64 across 8 nodes, ZeRO-1 data parallelism, no TP, DualPipe (which hides the EP all-to-all
  and the PP traffic behind computation), sequence 4,096, batch 15,360 sequences; 180K H800
  GPU-hours per trillion tokens = 1e12 / (180e3 x 3600) = 1,543 tokens/s per GPU. GEMMs ran in
  FP8, which this planner does not model: the prediction uses the bf16 peak (a lower bound on speed).
  Model states: AdamW moments in BF16 (section 3.3.3), ZeRO-1 as a distributed optimizer.
  Memory (H800: 80 GB) with the report's activation policies: every RMSNorm and the MLA
  up-projections recomputed in backward (section 3.2.3), the SwiGLU inputs of the experts cached in
  FP8 and its output recomputed (section 3.3.3). In Tessera's operator-level policy: keep the
  attention core, the products into attention (the latents), the router and the SwiGLU gate/up
  products, the last in FP8; everything else re-runs. Time is planned without recomputation, as
  calibrated: DeepSeek re-runs only cheap operators (norms, up-projections, SwiGLU), while Tessera's
  policy would also re-run the output and down projections and the expert dispatch, which DeepSeek
  keeps (its FP8 linear inputs and dispatched rows), so the memory layout is not its runtime.

Held-out runs (time and memory; chosen after the constants, nothing fitted to them):
- torchtitan's Llama 3.1 8B benchmarks (the torchtitan team, end of 2024, pytorch/torchtitan
  benchmarks/llama3_h100_202412_torchtitan.md), table 1 (8 GPUs, local batch 2, global batch 16)
  and table 3 (128 GPUs, global batch 256): FSDP, selective activation checkpointing (torchtitan's
  operator-level policy, its default for this model: every other matrix product and the attention
  kernel kept), sequence 8,192 (torchtitan's Llama 3 8B setting), BF16 parameters under FSDP2
  mixed precision; tokens/s per GPU and memory (GiB, the caching allocator's peak reservation)
  for FSDP alone and with torch.compile. Their H100s have 96 GB HBM2e at 2.4 TB/s and a 500 W
  limit, whose peak the report puts "between SXM and NVL": the `h100-96gb` preset takes the SXM's.
  Their kernels are torch's, not Megatron's: the attention core is `F.scaled_dot_product_attention`
  (torchtitan/models/llama/model.py), which on H100s in torch's December 2024 nightlies ran its
  flash backend (FlashAttention-2), cuDNN's having been made opt-in (pytorch/pytorch issue 142132,
  2024-12-05: 329 TFLOP/s forward against cuDNN's 631 at sequence 4,608, head 128, on
  2.6.0.dev20241204), and without torch.compile every RMSNorm, RoPE, GQA repeat and
  SwiGLU step is a kernel of its own. So the eager runs are priced with the `torch-eager` profile
  and the compiled ones with `tessera` (torch's SDPA and GEMMs, elementwise work fused by compile),
  both from published priors and counts, UNFITTED (efficiency.py); nothing was chosen on these runs.
  The report states its convention: tokens/s per GPU is each rank's tokens over the step's wall
  time divided by the non-data-parallel degree, and its "33% to 39% MFU" for these runs is
  6 N (N without the embedding) + 12 l h q t FLOPs per token over the SXM's 989 TFLOP/s
  (torchtitan train.py and utils.py at 9dec370): 5,762 and 6,667 tokens/s give 33.7% and 39.0%, so
  the sequence of 8,192 and local batch 2 transcribed here are the ones measured.
  The report's peak "between SXM and NVL" brackets the prediction: it is made at the SXM's
  (the preset) and at the NVL's, 835 TFLOP/s dense bf16 (NVIDIA H100 Tensor Core GPU datasheet,
  2023: H100 NVL 1,671 TFLOP/s bf16 with sparsity), the lowest peak the report allows. At the NVL's
  the four are within 25% (+13% to +23%), at the SXM's 30% to 39% over: the report says its 500 W
  GPUs do not reach the SXM's peak, and by how much it does not know, so the SXM end is not a
  peak they ran at. What the planner still leaves out, and would slow them: NCCL's FSDP kernels
  sharing the SMs with the GEMMs they overlap, and the data loading inside the measured step.
- The same report's runs with Float8 linears (torchao) and full activation checkpointing, held out
  for memory only: table 2 (Llama 3.1 8B on 8 GPUs, FSDP x CP = 8, local batch 1, sequence 32K to
  256K) and table 4 (Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16, global batch 512,
  without and with AsyncTP; its sequence length, not in the table, is torchtitan's Llama 3 70B
  setting, 8,192: torchtitan/models/llama/train_configs/llama3_70b.toml). Their time is not
  compared: the planner prices bf16 GEMMs, and Float8 linears change speed by tens of percent (table
  1). Their memory is: under full checkpointing a block keeps only its bf16 input, whatever its
  linears compute in, and FSDP all-gathers bf16 weights (torchtitan's Float8 all-gather is off by
  default), so Float8 leaves what the planner counts unchanged (tables 1 and 3 show it moving the
  peak by 0.2 GiB). The context parallelism is PyTorch's experimental ring attention with its
  default all-gather of keys and values and load-balanced (zig-zag) chunks: cp_method=allgather.
  torchtitan's tensor parallelism splits the norms along the sequence (sp) and computes the loss
  vocabulary-parallel, as Tessera's does. The 70B is `llama3-70b` (Llama 3.1 70B has its shapes).
- Every torchtitan run's loss is torch's, as torchtitan's train.py (at the report's commit 9dec370)
  computes it: `cross_entropy(pred.flatten(0, 1).float(), labels)`, `pred` deleted before backward,
  under torch's `loss_parallel` when TP splits the vocabulary (`loss="torch"`, loss_memory.py). Its
  buffers at the loss, measured on CPU by tests/plan/test_loss_memory.py, are 8 bytes per logit
  without TP and 12 with it beside the saved log-softmax, not the 6 the planner counted before: at
  16 x 8,192 tokens and 128,256 / 8 logits per token the 70B's loss alone holds 11.7 GiB more.
- What their memory figure is: torchtitan logs `memory` as the caching allocator's peak
  reservation (`reserved_bytes.all.peak`, torchtitan/metrics.py), run with
  `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (run_llama_train.sh), so it is at least the
  tensors' peak; the planner counts tensors, so a plan under it by a few GiB is the allocator's
  slack, not a tensor missed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.config.presets import get_preset
from tessera.plan.cluster import Cluster
from tessera.plan.estimate import Plan, make_plan
from tessera.plan.layout import Layout, Workload

METRICS = {"seconds_per_step": "s/step", "tflops_per_gpu": "TFLOP/s/GPU", "tokens_per_second_per_gpu": "tokens/s/GPU"}


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: ModelConfig
    gpu: str
    gpus: int
    layout: Layout
    work: Workload
    metric: str  # one of METRICS
    figure: float
    # Why the published figure is not compared with the prediction (None: it is); such a run is
    # checked for memory only
    time_not_compared: str | None = None
    activation_dtype: str = "bf16"
    precision: str = "bf16"
    held_out: bool = False  # False: a calibration run (the time constants were chosen with it in view)
    memory_gib: float | None = None  # the published per-GPU memory, GiB (None: only where it ran)
    profile: str = "megatron"  # the efficiency profile of its kernels (efficiency.py)
    # The layout its memory is planned with, where the source's memory policies differ from what its
    # time was planned with (None: `layout` for both)
    memory_layout: Layout | None = None
    # Where the source says its GPUs' peak is below the preset's but not by how much: the lowest peak
    # it allows (FLOP/s); the prediction is also made at it, bracketing the time error (None: exact)
    lowest_peak: float | None = None
    loss: str = "tessera"  # the cross-entropy's implementation, for the memory at the loss (loss_memory.py)


def _gpt(heads: int, hidden: int, layers: int) -> ModelConfig:
    """A Megatron GPT in Tessera's shapes: its 4h GeLU MLP as a SwiGLU with the same weights."""
    ffn = (8 * hidden // 3) // 8 * 8
    return get_preset("llama2-7b", vocab_size=51200, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                      ffn_dim=ffn, max_seq_len=2048)


_MEGATRON = "Korthikanti et al. 2022 (arXiv 2205.05198), tables 3 and 5"
# name: (heads, hidden, layers, tp, pp, gpus, global batch, seconds with SP + selective, with full recompute)
_MEGATRON_RUNS = {"22B": (64, 6144, 48, 8, 1, 8, 4, 1.10, 1.42), "175B": (96, 12288, 96, 8, 8, 64, 64, 13.75, 18.13),
                  "530B": (128, 20480, 105, 8, 35, 280, 280, 37.83, 49.05),
                  "1T": (160, 25600, 128, 8, 64, 512, 512, 71.49, 94.42)}


def _megatron_runs() -> list[PublishedRun]:
    out = []
    for name, (heads, hidden, layers, tp, pp, gpus, batch, selective, full) in _MEGATRON_RUNS.items():
        cfg = _gpt(heads, hidden, layers)
        work = Workload(seq_len=2048, micro_batch=1, global_batch=batch)
        for label, sp, recompute, figure in (("SP + selective recompute", True, "selective", selective),
                                             ("full recompute", False, "full", full)):
            lay = Layout(tp=tp, sp=sp, pp=pp, dp_shard=gpus // (tp * pp), zero_stage=1, recompute=recompute,
                         fused_attention=False)
            out.append(PublishedRun(f"Megatron-LM GPT {name}, {gpus} A100, {label}", _MEGATRON, cfg, "a100", gpus,
                                    lay, work, "seconds_per_step", figure))
    return out


def _llama3_405b() -> ModelConfig:
    return get_preset("llama3-70b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248)


def published_runs() -> list[PublishedRun]:
    llama = "Llama Team 2024 (arXiv 2407.21783), table 4"
    runs = _megatron_runs()
    for gpus, dp, figure in ((8192, 64, 430.0), (16384, 128, 400.0)):
        lay = Layout(tp=8, sp=True, pp=16, vpp=2, pp_schedule="interleaved_1f1b", dp_shard=dp, zero_stage=1)
        runs.append(PublishedRun(f"Llama 3 405B, {gpus} H100, TP8 CP1 PP16 DP{dp}", llama, _llama3_405b(), "h100",
                                 gpus, lay, Workload(8192, 1, 2048), "tflops_per_gpu", figure))
    lay = Layout(pp=16, pp_schedule="dualpipe", dp_shard=128, ep=64, zero_stage=1, ep_overlap=True,
                 optimizer="distributed")
    memory = dataclasses.replace(lay, recompute="op", recompute_save=DEEPSEEK_V3_SAVE, activation_fp8=("mlp_in",))
    runs.append(PublishedRun("DeepSeek-V3, 2048 H800, PP16 EP64 DP128 (DualPipe)",
                             "DeepSeek-AI 2024 (arXiv 2412.19437), sections 3.2, 3.3.3 and 4.2",
                             get_preset("deepseek-v3"), "h800", 2048, lay, Workload(4096, 1, 15360),
                             "tokens_per_second_per_gpu", 1e12 / (180e3 * 3600), precision="bf16-lowp-moments",
                             memory_layout=memory))
    return runs + _torchtitan_runs()


# DeepSeek-V3's memory policy (module docstring) as recompute=op's save list
DEEPSEEK_V3_SAVE = ("attention_core", "attention_in", "router", "mlp_in")
_TORCHTITAN = "torchtitan team, end of 2024 (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md)"
# gpus, global batch, table, (tokens/s per GPU, memory GiB) with FSDP, then with FSDP + torch.compile
_TORCHTITAN_RUNS = ((8, 16, 1, (5762, 82.4), (6667, 77.0)), (128, 256, 3, (5605, 67.0), (6514, 62.0)))


# Table 2, Llama 3.1 8B on 8 GPUs, FSDP + CP + compile + Float8, local batch 1, full checkpointing:
# (dp_shard, cp, sequence length, tokens/s per GPU, memory GiB)
_TORCHTITAN_CP_RUNS = ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0),
                       (1, 8, 262144, 548, 84.5))
# Table 4, Llama 3.1 70B on 256 GPUs (FSDP 32, TP 8) + compile + Float8, local batch 16, global batch 512,
# full checkpointing: (label, tokens/s per GPU, memory GiB)
_TORCHTITAN_70B_RUNS = (("2D", 829, 71.9), ("2D + AsyncTP", 876, 67.6))
H100_NVL_BF16 = 835e12  # dense bf16 FLOP/s of an H100 NVL (module docstring)
_FLOAT8 = ("Float8 linears: the planner prices bf16 GEMMs (memory only; tessera/plan/published.py "
           "says why Float8 leaves the counted memory unchanged)")


def _torchtitan_runs() -> list[PublishedRun]:
    out = []
    for gpus, batch, table, eager, compiled in _TORCHTITAN_RUNS:
        lay = Layout(dp_shard=gpus, zero_stage=3, recompute="op")
        for label, (tps, gib), profile in (("FSDP", eager, "torch-eager"), ("FSDP + compile", compiled, "tessera")):
            out.append(PublishedRun(f"torchtitan Llama 3.1 8B, {gpus} H100, {label}", f"{_TORCHTITAN}, table {table}",
                                    get_preset("llama3.1-8b"), "h100-96gb", gpus, lay, Workload(8192, 2, batch),
                                    "tokens_per_second_per_gpu", float(tps), held_out=True, memory_gib=gib,
                                    lowest_peak=H100_NVL_BF16, loss="torch", profile=profile))
    for shard, cp, seq, tps, gib in _TORCHTITAN_CP_RUNS:
        lay = Layout(dp_shard=shard, cp=cp, cp_method="allgather", zero_stage=3, recompute="full")
        out.append(PublishedRun(f"torchtitan Llama 3.1 8B, 8 H100, FSDP {shard} CP {cp}, seq {seq}, Float8",
                                f"{_TORCHTITAN}, table 2", get_preset("llama3.1-8b", max_seq_len=seq), "h100-96gb",
                                8, lay, Workload(seq, 1, shard), "tokens_per_second_per_gpu", float(tps),
                                time_not_compared=_FLOAT8, held_out=True, memory_gib=gib, loss="torch",
                                profile="tessera"))
    lay = Layout(tp=8, sp=True, dp_shard=32, zero_stage=3, recompute="full")
    for label, tps, gib in _TORCHTITAN_70B_RUNS:
        out.append(PublishedRun(f"torchtitan Llama 3.1 70B, 256 H100, {label} (FSDP 32 TP 8), Float8",
                                f"{_TORCHTITAN}, table 4", get_preset("llama3-70b"), "h100-96gb", 256, lay,
                                Workload(8192, 16, 512), "tokens_per_second_per_gpu", float(tps),
                                time_not_compared=_FLOAT8, held_out=True, memory_gib=gib, loss="torch",
                                profile="tessera"))
    return out


def plan_run(run: PublishedRun, profile: str | None = None, *, memory: bool = False,
             lowest_peak: bool = False) -> Plan:
    """The run planned on its GPUs with its efficiency profile (or `profile`); `memory`: with the
    layout its memory is checked with; `lowest_peak`: at the run's `lowest_peak`."""
    peak = {"gpu_flops": run.lowest_peak} if lowest_peak and run.lowest_peak is not None else {}
    cluster = Cluster.for_gpu(run.gpu, gpus=run.gpus, profile=profile or run.profile, **peak)
    lay = run.memory_layout if memory and run.memory_layout is not None else run.layout
    return make_plan(run.model, lay, run.work, cluster, precision=run.precision, activation_dtype=run.activation_dtype,
                     loss=run.loss)


def predicted_figure(run: PublishedRun, plan: Plan) -> float:
    """The plan's counterpart of the published figure."""
    if run.metric == "seconds_per_step":
        return plan.time.total
    if run.metric == "tflops_per_gpu":
        return plan.model_flops_per_step / plan.time.total / run.gpus / 1e12
    return plan.tokens_per_second / run.gpus
