"""Activation memory per rank: saved tensors per layer, cut by the layout, times the micro-batches
a pipeline stage holds in flight, plus the transient buffers that peak on top of them.

Per layer and micro-batch, `activation_terms` lists what autograd keeps on one process. A layout
changes it as Korthikanti et al. 2022 (arXiv 2205.05198, table 2) describe: tensor parallelism cuts
the head/FFN tensors by t; sequence parallelism also cuts the norm/residual region by t; context
parallelism splits the tokens by cp. Recomputation (`parallel.recompute`, on every
`recompute_interval`-th layer): full keeps only the layer's input; selective re-runs the attention
core; op keeps the layer's input and the outputs its save list names (saved/recompute_terms.py). With
`activation_offload` what the blocks save lives in host memory and only an op policy's cache (and
the token ids) stays on the GPU, plus one layer's activations brought back for its backward.
`korthikanti_layer_bytes` is their formula, for reference and comparison.

Pipeline stages hold several micro-batches' activations at once (Narayanan et al. 2021, section
2.2; Korthikanti et al. section 4.2.3): GPipe all m; 1F1B min(p - r, m) on rank r; interleaved 1F1B
on rank r `(v-1) p + 2 (p-r-1) + 1` model chunks (at most v m), i.e. p (1 + (p-1)/(p v)) stages'
worth on the first rank; the zero-bubble ZB-H1 schedule the same as 1F1B (Qi et al. 2023,
arXiv 2401.10241, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.plan.activation_dtypes import get_activation_dtype
from tessera.plan.layout import Layout, Workload
from tessera.plan.loss_memory import loss_buffer_bytes_per_logit
from tessera.plan.profile import ModelProfile, handoff_buffers
from tessera.plan.saved.activation_terms import head_saved_tensors, layer_saved_tensors, model_saved_tensors
from tessera.plan.saved.saved_terms import SavedTensor


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one GPT layer with 16-bit activations, Korthikanti et al. 2022, table 2:
    sbh(34 + 5as/h) unparallelised; sbh(10 + 24/t + 5as/(ht)) with tensor parallelism; sbh/t (34 +
    5as/h) with sequence parallelism too; the 5as/h term drops with selective recomputation; 2sbh
    (the layer input) with full recomputation."""
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sp else 1)
    attn_scores = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sp:
        return sbh / t * (34 + attn_scores)
    return sbh * (10 + 24 / t + attn_scores / t)


def in_flight_microbatches(schedule: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Micro-batches' worth of a stage's activations pipeline rank `rank` holds at its peak."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zero_bubble"):
        return float(min(p - rank, m))
    if schedule == "interleaved_1f1b":
        chunks = min((v - 1) * p + 2 * (p - rank - 1) + 1, m * v)
        return chunks / v
    if schedule == "dualpipe":  # DeepSeek-V3 table 2: PP + 1 micro-batches on every rank
        return float(min(p + 1, m))
    if schedule == "zb_v":  # 1F1B's peak on every rank (Qi et al. 2024: two chunks in a V)
        return float(min(p, m))
    raise ConfigError(f"pp_schedule={schedule!r} is invalid: one of gpipe, 1f1b, interleaved_1f1b, zero_bubble, "
                      "zb_v, dualpipe")


def head_in_flight(schedule: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Micro-batches' worth of the head's saved tensors (final norm, LM head input, the loss's saved
    log-probabilities) the rank holding the last stage keeps at its peak. DualPipe runs the last
    stage's backward of a micro-batch right after its forward (the turn of the V: torch's DualPipeV
    holds one micro-batch there at any time, against 2 p on its first stage), so the head is held once,
    not p + 1 times; every other schedule holds it as long as the stage's layers."""
    if schedule == "dualpipe" and p > 1:
        return 1.0
    return in_flight_microbatches(schedule, p, m, v, rank)


def _layer_recompute(lay: Layout, layer: int) -> str:
    """The policy layer `layer` runs: the layout's for every `recompute_interval`-th layer, else none."""
    return lay.recompute if layer % lay.recompute_interval == 0 else "none"


def layer_terms(cfg: ModelConfig, layer: int, lay: Layout, work: Workload, dtype: str,
                recompute: str | None = None) -> list[SavedTensor]:
    """What layer `layer` keeps per micro-batch on one rank of `lay`, as saved storages."""
    tokens = work.micro_batch * work.seq_len / lay.cp
    rc = _layer_recompute(lay, layer) if recompute is None else recompute
    e = cfg.moe
    return layer_saved_tensors(cfg, layer, dtype, recompute=rc, tokens=max(int(tokens), 1), batch=work.micro_batch,
                               save=lay.recompute_save, fp8=lay.activation_fp8,
                               local_experts=e.num_experts // lay.ep if e is not None else None,
                               core_kept=not (lay.cp > 1 and lay.cp_method == "ring"),
                               dispatch_dtype=lay.ep_dispatch_dtype, tp=lay.tp, device=lay.device)


def layer_activation_bytes(cfg: ModelConfig, layer: int, lay: Layout, work: Workload, dtype: str,
                           recompute: str | None = None) -> float:
    """Bytes layer `layer` keeps per micro-batch on one rank of `lay` (device and host together)."""
    tokens = work.micro_batch * work.seq_len / lay.cp
    return sum(t.nbytes(tokens, lay.tp, lay.sp) for t in layer_terms(cfg, layer, lay, work, dtype, recompute))


def layer_device_host_bytes(cfg: ModelConfig, layer: int, lay: Layout, work: Workload, dtype: str,
                            recompute: str | None = None) -> tuple[float, float]:
    """(bytes on the GPU, bytes in host memory) layer `layer` keeps per micro-batch. Without offload
    everything is on the GPU; with it, only what an op policy keeps in its cache (every term but the
    layer input: the saved tensors go through the offload hooks, the cache does not)."""
    tokens = work.micro_batch * work.seq_len / lay.cp
    rc = _layer_recompute(lay, layer) if recompute is None else recompute
    terms = layer_terms(cfg, layer, lay, work, dtype, rc)
    total = sum(t.nbytes(tokens, lay.tp, lay.sp) for t in terms)
    if not lay.activation_offload:
        return total, 0.0
    device = sum(t.nbytes(tokens, lay.tp, lay.sp) for t in terms if t.name != "layer.input") if rc == "op" else 0.0
    return device, total - device


def handoff_saved_bytes(cfg: ModelConfig, lay: Layout, work: Workload, dtype: str, prof: ModelProfile,
                        stage: int) -> float:
    """What the recurrent layers of `stage` keep for backward per micro-batch under context parallelism,
    beside their layer's own tensors: the state handoff's gathered buffers (every part's conv inputs,
    transitions and end states: states, not keys and values, so the same at any sequence length;
    comm.py), none where full or op recomputation re-runs the layer."""
    if lay.cp == 1:
        return 0.0
    dt = get_activation_dtype(dtype)
    total = 0.0
    for (mixer, applies), n in prof.stage_mixers(lay.pp, lay.vpp, stage, lay.recompute,
                                                 lay.recompute_interval).items():
        if mixer in ("delta", "ssd") and not (applies and lay.recompute in ("full", "op")):
            total += n * sum(handoff_buffers(cfg, mixer, lay, work.micro_batch, dt.compute).values())
    return total


@dataclass(frozen=True)
class StageActivations:
    """Activation memory of one rank of pipeline stage `stage`."""

    stage: int
    layers: int
    per_microbatch: float  # all the stage's layers, one micro-batch
    in_flight: float  # micro-batches' worth held at the peak
    head: float  # final norm + LM head input + loss (last stage), per micro-batch
    stored: float  # in_flight x (per_microbatch + head + model-level tensors), on the GPU
    recompute_buffer: float  # one layer's full activations rebuilt during its backward
    logits_buffer: float  # the logits and what the loss allocates beside its saved log-softmax (loss_memory.py)
    dispatch_buffer: float  # MoE all-to-all send + receive rows of one layer (ep > 1)
    offloaded: float = 0.0  # in host memory (parallel.activation_offload): in_flight x the layers' share
    reload_buffer: float = 0.0  # one layer's offloaded activations back on the GPU for its backward

    @property
    def transient(self) -> float:
        return max(self.recompute_buffer, self.logits_buffer, self.dispatch_buffer, self.reload_buffer)

    @property
    def total(self) -> float:
        return self.stored + self.transient

    def as_dict(self) -> dict[str, float]:
        return {"stage": self.stage, "layers": self.layers, "per_microbatch": self.per_microbatch,
                "in_flight": self.in_flight, "head": self.head, "stored": self.stored,
                "recompute_buffer": self.recompute_buffer, "logits_buffer": self.logits_buffer,
                "dispatch_buffer": self.dispatch_buffer, "offloaded": self.offloaded,
                "reload_buffer": self.reload_buffer, "total": self.total}


def stage_activations(cfg: ModelConfig, lay: Layout, work: Workload, dtype: str,
                      profile: ModelProfile | None = None, loss: str = "tessera") -> list[StageActivations]:
    """Activation memory of every pipeline stage (one rank each); `loss` names the cross-entropy's
    implementation (loss_memory.py: the trainer's, or torch's as torchtitan runs it)."""
    prof = profile or ModelProfile.of(cfg, work.seq_len)
    dt = get_activation_dtype(dtype)
    tokens = work.micro_batch * work.seq_len / lay.cp
    m = lay.microbatches(work)
    sizes = (tokens, lay.tp, lay.sp)
    constant = prof.memo(("act_model", dtype, lay.recompute, *sizes), lambda: sum(
        t.nbytes(*sizes) for t in model_saved_tensors(cfg, dtype, lay.recompute)))
    ids = sum(t.nbytes(*sizes) for t in model_saved_tensors(cfg, dtype) if t.name == "input_ids")
    head = prof.memo(("act_head", dtype, *sizes), lambda: sum(t.nbytes(*sizes) for t in head_saved_tensors(cfg, dtype)))

    def layer_bytes(kind: int, rc: str) -> tuple[float, float]:  # kind: the first layer of a `layer_kind`
        key = ("act_layer", dtype, kind, rc, *sizes, work.micro_batch, lay.cp, lay.ep, lay.cp_method,
               lay.recompute_save, lay.activation_fp8, lay.activation_offload, lay.ep_dispatch_dtype, lay.device)
        return prof.memo(key, lambda: layer_device_host_bytes(cfg, kind, lay, work, dtype, recompute=rc))

    per_logit = loss_buffer_bytes_per_logit(loss, lay.tp, dt.compute)
    out = []
    for s in range(lay.pp):
        last = s == lay.pp - 1
        flight = in_flight_microbatches(lay.pp_schedule, lay.pp, m, lay.vpp, s)
        per_mb = host = rebuilt = reload = 0.0
        kinds = prof.stage_layer_kinds(lay.pp, lay.vpp, s, lay.recompute, lay.recompute_interval)
        for (kind, applies), n in kinds.items():
            kept, away = layer_bytes(kind, lay.recompute if applies else "none")
            whole = sum(layer_bytes(kind, "none"))
            per_mb, host = per_mb + n * kept, host + n * away
            if whole > kept + away:
                rebuilt = max(rebuilt, whole)
            reload = max(reload, away)
        if lay.activation_offload:
            host += handoff_saved_bytes(cfg, lay, work, dtype, prof, s)
        else:
            per_mb += handoff_saved_bytes(cfg, lay, work, dtype, prof, s)
        stage_head = head if last else 0.0
        logits = tokens * cfg.vocab_size / lay.tp * per_logit if last else 0.0
        dispatch = 0.0
        if lay.ep > 1 and any(prof.moe[kind] for kind, _ in kinds):
            dispatch = 2.0 * tokens * cfg.moe.top_k * cfg.dim * dt.residual
        # Offloaded blocks save the RoPE tables through the hooks too: only the token ids stay.
        model_level = ids if lay.activation_offload else constant
        head_flight = head_in_flight(lay.pp_schedule, lay.pp, m, lay.vpp, s)
        out.append(StageActivations(stage=s, layers=sum(kinds.values()), per_microbatch=per_mb, in_flight=flight,
                                    head=stage_head, stored=flight * (per_mb + model_level) + head_flight * stage_head,
                                    recompute_buffer=rebuilt, logits_buffer=logits, dispatch_buffer=dispatch,
                                    offloaded=flight * (host + constant - model_level), reload_buffer=reload))
    return out
