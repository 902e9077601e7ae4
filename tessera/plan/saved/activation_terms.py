"""The tensors autograd keeps for backward in one decoder layer, op by op, as `tessera.models` runs it.

Korthikanti et al. 2022 (arXiv 2205.05198, section 4.1) count activation memory by listing what
each op of a GPT layer saves for its backward: `sbh(34 + 5as/h)` bytes with 16-bit activations.
This module does the same for Tessera's layer (RMSNorm computed in fp32, GQA or MLA attention
through SDPA, a SwiGLU or relu^2 MLP, or a routed MoE of either, or gpt-oss's, with shared experts),
so GQA, SwiGLU and MoE are counted from their ops rather than scaled from GPT's constants. A test
checks the list against the bytes that `torch.autograd.graph.saved_tensors_hooks` sees on CPU.

Conventions (what "activation bytes" means here):
- A tensor is counted once per storage, whatever the number of ops that save it or its views
  (a view saves its whole base storage).
- Parameters, and casts or views of parameters (autocast's bf16 weight copies), are not counted:
  they are model state (memory.py).
- The attention kernel is SDPA's flash/memory-efficient kind: it keeps q, k, v, the output and
  the fp32 log-sum-exp, never the s x s probabilities (Korthikanti's 5as/h term is 0). On the CPU
  an MLA layer whose value head is narrower than its query/key head takes SDPA's math kernel, which
  keeps the probabilities (`_math_core`, for `device` cpu); sliding-window masks keep more too.
- Integers count: token and expert indices are int64, grouped-GEMM offsets int32, the
  capacity's keep mask bool.
- Three precisions (`ACTIVATION_DTYPES`, activation_dtypes.py): fp32; bf16 (weights and
  activations bf16, as FSDP2's mixed precision runs a model); autocast-bf16 (fp32 weights under
  torch.autocast, the trainer's `train.dtype: bf16`: the residual stream stays fp32, every linear
  saves its own bf16 copy of an fp32 input, the routed experts cast their rows and weights to bf16
  as a linear would (so their GEMMs run, save and return bf16, and the combine works on bf16
  outputs), and the router runs with autocast off: fp32 logits from its fp32 input, with no bf16 copy).
- Sizes are per token of the micro-batch on one process; `split` says how tensor parallelism
  divides them: "tp" (cut by heads, FFN columns or vocabulary), "seq" (cut only under sequence
  parallelism: the norm/residual region), "rep" (whole on every tp rank: MLA latents, routed
  token rows, which expert TP needs in full).
"""

from __future__ import annotations

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.config.parallel import RECOMPUTE_CHOICES, TORCHTITAN_SAVE
from tessera.plan.activation_dtypes import ActivationDtype, get_activation_dtype
from tessera.plan.saved.recompute_terms import MLP_PRODUCTS, op_saved_tensors
from tessera.plan.saved.recurrent_terms import recurrent_linear_inputs, recurrent_mixer_terms
from tessera.plan.saved.saved_terms import (
    SavedSet,
    SavedTensor,
    Storage,
    expert_rows,
    grouped_experts_apply,
    math_attention,
)


def _rms_norm(s: SavedSet, name: str, src: Storage, n: float, rows: float, dt: ActivationDtype,
              offset_width: int = 0) -> Storage:
    """RMSNorm in fp32: keeps its fp32 input (a copy unless already fp32), 1/rms per row and the
    normalised value in the input dtype (for the gain's gradient). Returns its output. Gemma's
    (1 + weight) norm (`offset_width`: the weight's length) multiplies in fp32, so it keeps the
    normalised value in fp32 and its fp32 (1 + weight), and returns the input's dtype."""
    if src.itemsize == 4:
        s.keep(src)  # x.float() is x itself; for a view this is the whole base storage
    else:
        s.new(f"{name}.input_fp32", n, 4, src.split)
    s.new(f"{name}.rstd", rows, 4, src.split)
    if offset_width:
        s.new(f"{name}.normalised", n, 4, src.split)
        s.new(f"{name}.one_plus_weight", 0, 4, "rep", fixed=offset_width)
        return Storage(f"{name}.out", n, src.itemsize, src.split)
    s.new(f"{name}.normalised", n, src.itemsize, src.split)
    return Storage(f"{name}.out", n, max(dt.weight, src.itemsize), src.split)


def _linear_input(s: SavedSet, x: Storage, n: float, consumer: str, dt: ActivationDtype) -> None:
    """A linear layer keeps its input; under autocast an fp32 input becomes its own bf16 copy."""
    if dt.autocast and x.itemsize == 4:
        s.new(f"{consumer}.input_bf16", n, 2, x.split)
    else:
        s.keep(x)


def _attention_core(s: SavedSet, name: str, q: Storage, k: Storage, v: Storage, q_n: float, k_n: float,
                    out_n: float, heads: int, dt: ActivationDtype, recompute: str) -> Storage:
    """SDPA (flash kind) keeps q, k, v, its output and the fp32 log-sum-exp per head. Selective
    recomputation re-runs it from its inputs as they were before autocast's casts, so only the
    output (kept anyway by the output projection) and the log-sum-exp go."""
    out = Storage(f"{name}.out", out_n, dt.compute, "tp")
    if recompute == "selective":
        for t in (q, k, v, out):  # the output stays as the output projection's input
            s.keep(t)
        return out
    for t, n in ((q, q_n), (k, k_n), (v, None)):
        if dt.autocast and t.itemsize == 4:
            s.new(f"{t.key}.sdpa_bf16", n if n is not None else t.per_token, 2, "tp")
        else:
            s.keep(t)
    s.keep(out)
    s.new(f"{name}.logsumexp", heads, 4, "tp")
    return out


def _unit_rms(s: SavedSet, name: str, src: Storage, n: float, rows: float) -> Storage:
    """Llama 4's weightless QK norm, in fp32: keeps its fp32 input (a copy unless already fp32) and
    1/rms per head; its output is cast back to the input's dtype."""
    if src.itemsize == 4:
        s.keep(src)
    else:
        s.new(f"{name}.input_fp32", n, 4, src.split)
    s.new(f"{name}.rstd", rows, 4, src.split)
    return Storage(f"{name}.out", n, src.itemsize, src.split)


def _gqa(s: SavedSet, cfg: ModelConfig, x: Storage, dt: ActivationDtype, recompute: str, layer: int = 0,
         seq: int = 0) -> None:
    h, a, g, d = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    for name in ("wq", "wk", "wv"):
        _linear_input(s, x, h, f"attention.{name}", dt)
    q = Storage("attention.q", a * d, dt.compute, "tp")
    k = Storage("attention.k", g * d, dt.compute, "tp")
    v = Storage("attention.v", g * d, dt.compute, "tp")
    if cfg.qk_norm:  # one 1/rms per head, or one per token over all heads (OLMo 2)
        all_heads = cfg.qk_norm_all_heads
        q = _rms_norm(s, "attention.q_norm", q, a * d, 1 if all_heads else a, dt,
                      cfg.norm_unit_offset * (a * d if all_heads else d))
        k = _rms_norm(s, "attention.k_norm", k, g * d, 1 if all_heads else g, dt,
                      cfg.norm_unit_offset * (g * d if all_heads else d))
    # RoPE keeps only cos and sin (model-level); its output promotes to the cos/sin dtype. A NoPE layer has none.
    if layer not in cfg.nope_layers:
        q = Storage("attention.q_rope", a * d, max(q.itemsize, dt.residual), "tp")
        k = Storage("attention.k_rope", g * d, max(k.itemsize, dt.residual), "tp")
    if cfg.qk_l2_norm and layer not in cfg.nope_layers:  # Llama 4, after RoPE
        q, k = _unit_rms(s, "attention.q_l2", q, a * d, a), _unit_rms(s, "attention.k_l2", k, g * d, g)
    if cfg.nope_attn_scale > 0 and layer in cfg.nope_layers:  # q times the temperature (model-level): a new q
        q = Storage("attention.q_tempered", a * d, q.itemsize, "tp")
    if cfg.attention_sinks and recompute != "selective":
        _sink_core(s, q, k, v, a, g, d, dt, seq)
    else:
        _attention_core(s, "attention.sdpa", q, k, v, a * d, g * d, a * d, a, dt, recompute)
    if cfg.attention_output_gate:  # Qwen3-Next: wo(out * sigmoid(gate)) keeps the sigmoid and the product
        s.new("attention.gate_sigmoid", a * d, dt.compute, "tp")
        s.new("attention.gated_out", a * d, dt.compute, "tp")


def _sink_core(s: SavedSet, q: Storage, k: Storage, v: Storage, a: int, g: int, d: int, dt: ActivationDtype,
               seq: int) -> None:
    """gpt-oss's attention with sinks (models/attention_variants/attention_sinks.py), explicit in fp32: the two products
    keep fp32 q, k and v with k and v repeated to every query head (copies unless already fp32 and
    one per head), its bool [S, S] mask (every layer, causal or windowed), the fp32 probabilities
    over the S keys and the sink (softmax keeps its output), and the output (the output projection's
    input). Under autocast the products' bf16 copies of q, k^T, the probabilities and v instead."""
    for t, n in ((q, a * d), (k, g * d), (v, g * d)):
        if dt.autocast:
            s.new(f"{t.key}.sinks_bf16", a * d, 2, "tp")
        elif t.itemsize == 4 and n == a * d:
            s.keep(t)
        else:
            s.new(f"{t.key}.sinks_fp32", a * d, 4, "tp")
    s.new("attention.sinks.mask", 0, 1, "rep", fixed=seq * seq)
    s.new("attention.sinks.probs", a * (seq + 1), 4, "tp")
    if dt.autocast:
        s.new("attention.sinks.probs_bf16", a * seq, 2, "tp")
    s.keep(Storage("attention.sdpa.out", a * d, dt.compute, "tp"))


def _math_core(s: SavedSet, name: str, qk: float, v: float, heads: int, seq: int, dt: ActivationDtype) -> Storage:
    """SDPA's math kernel (the CPU's, where the value head size differs: `math_attention`), in fp32 whatever
    the inputs' dtype: its two products keep q and k^T each scaled by sqrt(scale), the probabilities over the
    S keys (softmax keeps its output) and a contiguous copy of v; nothing keeps q, k or v themselves, nor a
    log-sum-exp. Its [B, H, S, V] output is cast back and transposed, so the output projection's input is a
    copy of its own."""
    for part, n in (("q_scaled", qk), ("k_scaled", qk), ("probs", heads * seq), ("v", v)):
        s.new(f"{name}.math.{part}", n, 4, "tp")
    return s.new(f"{name}.out", v, dt.compute, "tp")


def _mla(s: SavedSet, cfg: ModelConfig, x: Storage, dt: ActivationDtype, recompute: str, layer: int = 0,
         seq: int = 0, math: bool = False) -> None:
    m, h, a = cfg.mla, cfg.dim, cfg.n_heads
    nope, rope, vd, rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    # RoPE's output and the concatenations that hold it (promoted to the tables' dtype); unrotated (a NoPE
    # layer: Kimi Linear's) q and k stay in the projections' dtype
    roped = dt.compute if layer in cfg.nope_layers else max(dt.compute, dt.residual)
    if m.q_lora_rank is not None:
        _linear_input(s, x, h, "mla.wq_a", dt)
        qa = Storage("mla.wq_a.out", m.q_lora_rank, dt.compute, "rep")
        qn = _rms_norm(s, "mla.q_norm", qa, m.q_lora_rank, 1, dt)
        _linear_input(s, qn, m.q_lora_rank, "mla.wq_b", dt)
    else:
        _linear_input(s, x, h, "mla.wq", dt)
    _linear_input(s, x, h, "mla.wkv_a", dt)
    kva = Storage("mla.wkv_a.out", rank + rope, dt.compute, "rep")
    if kva.itemsize == 4:  # c_kv is a view of kv_a: x.float() keeps the whole storage
        s.keep(kva)
        s.new("mla.kv_norm.rstd", 1, 4, "rep")
        s.new("mla.kv_norm.normalised", rank, 4, "rep")
        kvn = Storage("mla.kv_norm.out", rank, max(dt.weight, 4), "rep")
    else:
        kvn = _rms_norm(s, "mla.kv_norm", Storage("mla.c_kv", rank, kva.itemsize, "rep"), rank, 1, dt)
    _linear_input(s, kvn, rank, "mla.wkv_b", dt)
    kvb = Storage("mla.wkv_b.out", a * (nope + vd), dt.compute, "tp")  # v is a view of it
    q = Storage("mla.q", a * (nope + rope), roped, "tp")  # cat(q_nope, rope(q_rope))
    k = Storage("mla.k", a * (nope + rope), roped, "tp")  # cat(k_nope, rope(k_rope) expanded)
    if math and recompute != "selective":  # (selective re-runs the core: what stays is the flash kind's)
        _math_core(s, "mla.sdpa", a * (nope + rope), a * vd, a, seq, dt)
        return
    _attention_core(s, "mla.sdpa", q, k, kvb, a * (nope + rope), a * (nope + rope), a * vd, a, dt, recompute)


def _swiglu(s: SavedSet, name: str, x: Storage, rows: float, h: int, f: int, itemsize: int, dt: ActivationDtype,
            split_rows: str = "tp") -> None:
    """w2(silu(w1 x) * w3 x) keeps x, w1 x, w3 x, silu(w1 x) and their product."""
    _linear_input(s, x, h * rows, f"{name}.w1", dt)
    _linear_input(s, x, h * rows, f"{name}.w3", dt)
    for part in ("w1_out", "w3_out", "silu_out", "product"):
        s.new(f"{name}.{part}", rows * f, itemsize, split_rows)


def _relu2(s: SavedSet, name: str, x: Storage, rows: float, h: int, f: int, itemsize: int,
           dt: ActivationDtype) -> None:
    """w2(relu(w1 x)^2) (Nemotron-H's MLP and experts) keeps x, relu(w1 x) (the square's input) and the square."""
    _linear_input(s, x, h * rows, f"{name}.w1", dt)
    for part in ("relu", "square"):
        s.new(f"{name}.{part}", rows * f, itemsize, "tp")


MLP_TERMS = {"swiglu": _swiglu, "relu2": _relu2}  # what an MLP of each activation keeps


def _moe(s: SavedSet, cfg: ModelConfig, x: Storage, dt: ActivationDtype, tokens: int, batch: int) -> None:
    """A routed MoE layer on its normalised input `x`, in the order its ops run: router and balancing
    losses, dispatch, the routed experts, combine, shared experts."""
    logits = _router(s, cfg, x)
    _balance_losses(s, cfg, logits, batch)
    x_in = x
    if cfg.moe.gate_input:  # Llama 4: x.float() * gate keeps both (x itself when fp32); cast back
        s.keep(x if x.itemsize == 4 else Storage("moe.gate_input.x_fp32", cfg.dim, 4, x.split))
        s.new("moe.gate_input.gate", cfg.moe.top_k, 4, "seq")
        x_in = Storage("moe.gate_input.x", cfg.dim, x.itemsize, x.split)
    gathered, rows = _dispatch(s, cfg, x_in, dt, tokens)
    if cfg.moe.expert_activation == "clamped_swiglu":
        _clamped_swiglu(s, cfg, gathered, rows, dt)
    else:  # SwiGLU or relu^2 experts
        MLP_TERMS[cfg.moe.expert_activation](s, "moe.experts", gathered, rows, cfg.dim, cfg.moe.ffn_dim, dt.compute, dt)
    _combine(s, cfg, dt)
    if cfg.moe.shared_ffn_dim > 0:
        _shared_experts(s, cfg, x, dt)


def _clamped_swiglu(s: SavedSet, cfg: ModelConfig, x: Storage, rows: float, dt: ActivationDtype) -> None:
    """gpt-oss's biased experts (models/moe/biased_experts.py): one product into the interleaved
    gate / up h (the clamps keep h), then sigmoid(alpha g), g, u + 1 and g * sigmoid kept by the
    products, and the down projection's input; each bias added by row keeps its repeat index."""
    f = cfg.moe.ffn_dim
    _linear_input(s, x, cfg.dim * rows, "moe.experts.gate_up", dt)
    s.new("moe.experts.gate_up_out", rows * 2 * f, dt.compute, "rep")
    for part in ("sigmoid", "gate", "up_plus_1", "gated", "product"):
        s.new(f"moe.experts.{part}", rows * f, dt.compute, "rep")
    for name in ("gate_up", "down"):
        s.new(f"moe.experts.{name}_bias.row_index", cfg.moe.top_k, 8, "rep")


def _router(s: SavedSet, cfg: ModelConfig, x: Storage) -> Storage:
    """Scores and top-k choice of the router (with its input jitter). Returns its fp32 logits."""
    e, h = cfg.moe, cfg.dim
    E, k = e.num_experts, e.top_k
    xr = x  # the router's input: jittered in training (the experts see the original tokens)
    if e.jitter_eps > 0:
        s.new("moe.jitter_noise", h, x.itemsize, x.split)
        xr = Storage("moe.x_jittered", h, x.itemsize, x.split)
    # Router: fp32 logits from x.float() @ W.float().T with autocast off, so the matmul keeps the
    # fp32 input (x itself when x is fp32, else its fp32 copy) and no bf16 copy is made.
    s.keep(xr if xr.itemsize == 4 else Storage("moe.router.x_fp32", h, 4, x.split))
    logits = Storage("moe.router.logits", E, 4, "seq")
    if e.score_func == "softmax" and not e.softmax_before_topk:
        _topk_indices(s, cfg)
        s.keep(logits)  # gather(logits.float(), idx) keeps its input
        s.new("moe.router.topk_softmax", k, 4, "seq")
    else:
        s.new("moe.router.scores", E, 4, "seq")
        _topk_indices(s, cfg)
        if e.norm_topk_prob and k > 1:
            s.new("moe.router.topk_weights", k, 4, "seq")
            s.new("moe.router.topk_sum", 1, 4, "seq")
    return logits


def _balance_losses(s: SavedSet, cfg: ModelConfig, logits: Storage, batch: int) -> None:
    """The load-balancing losses (global and per sequence) and the router z-loss, where switched on."""
    e, E = cfg.moe, cfg.moe.num_experts
    if e.aux_loss_coef > 0 or e.seq_aux_loss_coef > 0:
        s.new("moe.balance.probs", E, 4, "seq")
        if e.score_func == "sigmoid":
            s.new("moe.balance.probs_sum", 1, 4, "seq")
        if e.aux_loss_coef > 0:
            s.new("moe.balance.f", 0, 4, "rep", fixed=E)
        if e.seq_aux_loss_coef > 0:
            s.new("moe.balance.seq_f", 0, 4, "rep", fixed=batch * E)
    if e.z_loss_coef > 0:
        s.keep(logits)  # logsumexp(logits.float()) keeps its input
        s.new("moe.z_loss.logsumexp", 1, 4, "seq")


def _dispatch(s: SavedSet, cfg: ModelConfig, x: Storage, dt: ActivationDtype, tokens: int
              ) -> tuple[Storage, float]:
    """Dispatch (LocalDispatcher): all T*k routing slots in expert order, a gather of x by token
    index (the index is kept, and kept again by the combine's index_add). With a capacity, the
    dropped slots' rows are zeroed by a `where` on the bool keep mask (that `where` and the
    combine's keep the mask, one storage); padding then copies the rows into an [E*capacity + 1, D] buffer (the
    last row a scratch row for dropped slots) whose first E*capacity rows the experts take, a
    view that keeps the whole storage. The experts' grouped GEMMs (or their loop fallback) cast
    their input and weights to the autocast dtype as nn.Linear would, so they keep what a linear
    layer keeps (`_linear_input`: under autocast, w1 and w3 each their own bf16 copy of the fp32
    rows, without the scratch row) and compute in dt.compute; `_grouped_mm` applies when the
    rows are 16-byte aligned in that dtype. Returns the experts' input and its rows per token."""
    e, h = cfg.moe, cfg.dim
    k = e.top_k
    capacity, padded = e.capacity_factor is not None, e.capacity_factor is not None and e.pad_to_capacity
    rows = expert_rows(cfg, tokens)
    s.new("moe.dispatch.token_index", k, 8, "rep")
    gathered = Storage("moe.dispatch.rows", k * h, x.itemsize, "rep")
    if capacity:
        s.new("moe.dispatch.keep_mask", k, 1, "rep")
    if padded:
        s.new("moe.dispatch.padded_row", k, 8, "rep")  # index_copy keeps its index and source
        s.keep(gathered)
        gathered = Storage("moe.dispatch.padded", rows * h, x.itemsize, "rep", fixed=h)
    if grouped_experts_apply(cfg, dt):  # one offsets tensor per grouped product
        for name, *_ in MLP_PRODUCTS[e.expert_activation](h, e.ffn_dim):
            s.new(f"moe.experts.{name}.offsets", 0, 4, "rep", fixed=e.num_experts)
    return gathered, rows


def _combine(s: SavedSet, cfg: ModelConfig, dt: ActivationDtype) -> None:
    """Combine, on the experts' output y (dt.compute): when padded, a gather of the slots' rows
    (keeps its own index: the padded row, 0 for dropped slots); with a capacity, a `where` that
    zeroes the dropped slots' rows (keeps only the mask, counted by `_dispatch`); the gate weights
    gathered by slot index (keeps it); y.float() * gate (keeps both; y.float() is y itself when
    y is fp32), cast back to y's dtype; index_add by token index (keeps its source, and the
    index counted by `_dispatch`)."""
    e, h = cfg.moe, cfg.dim
    k = e.top_k
    if e.capacity_factor is not None and e.pad_to_capacity:
        s.new("moe.combine.padded_row", k, 8, "rep")
    if not e.gate_input:  # with it the gates are ones: no gradient, so neither the index nor y.float() stays
        s.new("moe.combine.slot_index", k, 8, "rep")
        s.new("moe.combine.y_fp32", k * h, 4, "rep")
    s.new("moe.combine.gate", k, 4, "rep")
    s.new("moe.combine.weighted", k * h, dt.compute, "rep")


def _shared_experts(s: SavedSet, cfg: ModelConfig, x: Storage, dt: ActivationDtype) -> None:
    """The shared experts' SwiGLU (relu^2 beside relu^2 experts) on every token, and its sigmoid gate where the
    model has one."""
    h, relu2 = cfg.dim, cfg.moe.expert_activation == "relu2"
    (_relu2 if relu2 else _swiglu)(s, "moe.shared", x, 1, h, cfg.moe.shared_ffn_dim, dt.compute, dt)
    if cfg.moe.shared_expert_gate:
        _linear_input(s, x, h, "moe.shared_gate", dt)
        s.new("moe.shared_gate.sigmoid", 1, dt.compute, "seq")
        s.new("moe.shared.out", h, dt.compute, "seq")


def _topk_indices(s: SavedSet, cfg: ModelConfig) -> None:
    """The chosen experts' int64 indices, kept by the gather of the gate weights. (The top-k ops
    of group-limited choice also save indices, but only their indices are used, so autograd frees
    those nodes, and what they saved, before backward.)"""
    s.new("moe.router.topk_index", cfg.moe.top_k, 8, "seq")


def layer_saved_tensors(cfg: ModelConfig, layer: int, dtype: str = "bf16", *, recompute: str = "none",
                        tokens: int = 4096, batch: int = 1, save: tuple[str, ...] = TORCHTITAN_SAVE,
                        fp8: tuple[str, ...] = (), local_experts: int | None = None,
                        core_kept: bool = True, dispatch_dtype: str = "input", tp: int = 1,
                        device: str = "cuda") -> list[SavedTensor]:
    """What decoder layer `layer` keeps for backward (a recurrent mixer's on one rank of `tp`:
    recurrent_terms.py). `recompute`: none; full (the layer is
    checkpointed: only its input stays); selective (the attention core is recomputed); op (only the
    outputs `save` names stay, those of the `fp8` roles in FP8: recompute_terms.py). `tokens` and
    `batch` matter only for capacity-limited MoE and per-sequence statistics; `local_experts` and
    `core_kept` (an SDPA core, not ring attention) only for op. `device`: cuda or cpu, where SDPA's kernel
    may differ (saved_terms.py's `math_attention`)."""
    dt = get_activation_dtype(dtype)
    h = cfg.dim
    layer_input = Storage("layer.input", h, dt.residual, "seq")
    if recompute not in RECOMPUTE_CHOICES:
        raise ConfigError(f"recompute={recompute!r} is invalid: one of {', '.join(RECOMPUTE_CHOICES)}")
    if recompute == "full":
        return [SavedTensor(layer_input.key, h, dt.residual, "seq")]
    math = math_attention(cfg, device)
    if recompute == "op":  # the math kernel's products run inside the core: it re-runs, nothing of it is kept
        return op_saved_tensors(cfg, layer, dtype, save, fp8, tokens=tokens, local_experts=local_experts,
                                core_kept=core_kept and not math, dispatch_dtype=dispatch_dtype)
    s = SavedSet()
    if cfg.sublayers is not None:
        return _sublayer(s, cfg, layer, layer_input, dt, recompute, tokens, batch, tp)
    pre, post = cfg.block_norms in ("pre", "pre_post"), cfg.block_norms in ("post", "pre_post")
    off = h if cfg.norm_unit_offset else 0  # (1 + weight) norms: Gemma 3, Qwen3-Next
    xn = _rms_norm(s, "attention_norm", layer_input, h, 1, dt, off) if pre else layer_input
    if cfg.is_linear_attention_layer(layer):
        _recurrent(s, cfg, layer, xn, dt, tokens, batch, tp)
    elif cfg.mla is not None:
        _mla(s, cfg, xn, dt, recompute, layer, tokens // max(batch, 1), math)
    else:
        _gqa(s, cfg, xn, dt, recompute, layer, tokens // max(batch, 1))
    if not cfg.is_linear_attention_layer(layer):
        _window_mask(s, cfg, layer, tokens // max(batch, 1), dt)
    if post:  # on the output projection's output, before the residual add (OLMo 2, Gemma 3)
        _rms_norm(s, "attention_post_norm", Storage("attention.wo.out", h, dt.compute, "seq"), h, 1, dt, off)
    mid = Storage("layer.mid", h, dt.residual, "seq")  # x + attention(x): residual dtype
    xn = _rms_norm(s, "ffn_norm", mid, h, 1, dt, off) if pre else mid
    if cfg.is_moe_layer(layer):
        _moe(s, cfg, xn, dt, tokens, batch)
    else:
        _swiglu(s, "feed_forward", xn, 1, h, cfg.ffn_dim, dt.compute, dt)
    if post:
        _rms_norm(s, "ffn_post_norm", Storage("ffn.out", h, dt.compute, "seq"), h, 1, dt, off)
    return list(s.items.values())


def _recurrent(s: SavedSet, cfg: ModelConfig, layer: int, xn: Storage, dt: ActivationDtype, tokens: int,
               batch: int, tp: int) -> None:
    """A recurrent mixer (recurrent_terms.py): each projection keeps the normalised input, then the
    mixer's own storages."""
    for name in recurrent_linear_inputs(cfg, layer):
        _linear_input(s, xn, cfg.dim, f"mixer.{name}", dt)
    for t in recurrent_mixer_terms(cfg, layer, dt, tokens, batch, tp):
        s.items[t.name] = t


def _sublayer(s: SavedSet, cfg: ModelConfig, layer: int, x: Storage, dt: ActivationDtype, recompute: str,
              tokens: int, batch: int, tp: int) -> list[SavedTensor]:
    """A layer of one sublayer (Nemotron-H, models/sublayer_block.py): its norm, then a Mamba-2 mixer,
    attention, an ungated relu^2 MLP (keeps relu(w1 x) and its square) or an MoE layer."""
    kind, h = cfg.sublayers[layer], cfg.dim
    xn = _rms_norm(s, "norm", x, h, 1, dt, h if cfg.norm_unit_offset else 0)
    if kind == "mamba":
        _recurrent(s, cfg, layer, xn, dt, tokens, batch, tp)
    elif kind == "attention":
        _gqa(s, cfg, xn, dt, recompute, layer, tokens // max(batch, 1))
        _window_mask(s, cfg, layer, tokens // max(batch, 1), dt)
    elif kind == "moe":
        _moe(s, cfg, xn, dt, tokens, batch)
    else:
        _relu2(s, "feed_forward", xn, 1, h, cfg.ffn_dim, dt.compute, dt)
    return list(s.items.values())


def _window_mask(s: SavedSet, cfg: ModelConfig, layer: int, seq: int, dt: ActivationDtype) -> None:
    """A windowed layer shorter than the sequence attends under an [S, S] mask, which SDPA keeps in
    the attention's dtype (one per layer: each call builds its own). Sink layers count their bool
    mask in `_sink_core`."""
    if cfg.attention_sinks:
        return
    window = cfg.layer_window(layer)
    if cfg.attention_chunk_size is not None and layer not in cfg.nope_layers:  # Llama 4's chunks: a mask too
        window = cfg.attention_chunk_size
    if window is not None and window < seq:
        s.new("attention.window_mask", 0, dt.compute, "rep", fixed=seq * seq)


def model_saved_tensors(cfg: ModelConfig, dtype: str = "bf16", recompute: str = "none") -> list[SavedTensor]:
    """Saved once per micro-batch whatever the layers: the token ids (embedding backward) and the
    RoPE cos and sin tables every layer multiplies by (one storage each, shared; the window layers'
    own pair besides, model.local_rope_theta), where a layer rotates or `recompute` re-runs blocks."""
    dt = get_activation_dtype(dtype)
    rope = cfg.rope_dim  # the rotated part of a head: all of it, MLA's RoPE part, or a partial share (GLM-4.5)
    rotates = any(cfg.has_attention(i) and i not in cfg.nope_layers for i in range(cfg.n_layers))
    if not rotates and recompute not in ("full", "op"):  # a re-run block keeps its inputs, the tables among them
        return [SavedTensor("input_ids", 1, 8, "rep")]  # no layer rotates (Nemotron-H): no layer keeps the tables
    tables = ("rope", "local_rope") if cfg.local_rope_theta is not None else ("rope",)  # the window layers' own
    if cfg.nope_attn_scale > 0 and cfg.nope_layers:  # Llama 4's query temperature per position, fp32, shared
        return [SavedTensor("input_ids", 1, 8, "rep"), SavedTensor("nope_temperature", 1, 4, "rep")] + [
            SavedTensor(f"{t}.{f}", rope, dt.residual, "rep") for t in tables for f in ("cos", "sin")]
    return [SavedTensor("input_ids", 1, 8, "rep")] + [SavedTensor(f"{t}.{f}", rope, dt.residual, "rep")
                                                      for t in tables for f in ("cos", "sin")]


def head_saved_tensors(cfg: ModelConfig, dtype: str = "bf16") -> list[SavedTensor]:
    """Final norm, LM head input, and a cross-entropy computed in fp32 as `tessera.train.objectives.loss` does
    (it keeps the fp32 log-softmax, V per token, cut by vocabulary-parallel tp, and the int64
    targets)."""
    dt = get_activation_dtype(dtype)
    s = SavedSet()
    xn = _rms_norm(s, "norm", Storage("final.input", cfg.dim, dt.residual, "seq"), cfg.dim, 1, dt,
                   cfg.dim if cfg.norm_unit_offset else 0)
    _linear_input(s, xn, cfg.dim, "output", dt)
    s.new("loss.log_softmax", cfg.vocab_size, 4, "tp")
    s.new("loss.targets", 1, 8, "rep")
    s.new("loss.total_weight", 0, 4, "rep", fixed=1)  # nll_loss keeps the (scalar) weight sum
    return list(s.items.values())
