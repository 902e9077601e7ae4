"""What an operator-level recomputation policy (`parallel.recompute=op`) keeps of one decoder layer,
and what it recomputes, as tessera/parallel/memory/recompute_policy.py runs it.

Under that policy a block keeps its input (the checkpoint's saved input, in the residual dtype)
and the outputs of the operators its save list names; everything else re-runs in backward. So
the bytes are those of a list of operator outputs, and the recomputed work is the products not
kept plus everything that is not a product (norms, RoPE, activations, routing: memory-bound work)
plus the attention core unless kept (an SDPA kernel's: a core with sinks, gpt-oss's explicit
softmax, re-runs; saved_terms.py's `sdpa_core`). This module lists a layer's matrix products in the
order the block runs them, with the role the policy gives each (`tessera.config.parallel`,
RECOMPUTE_SAVE_CHOICES), their output sizes and their GEMM shapes:

    GQA: wq (with Qwen3-Next's per-head gate beside q), wk, wv (attention_in), [core], wo (attention_out)
    MLA: wq_a (attention_in), wq_b (mla_up) | wq (attention_in); wkv_a (attention_in), wkv_b (mla_up), [core], wo
    Gated DeltaNet: in_proj_qkvz, in_proj_ba | in_proj_z, in_proj_qkv, in_proj_b, in_proj_a (attention_in),
                    [core], out_proj (attention_out)
    Kimi delta attention: q, k, v, f_a, f_b, b (attention_in), [core], g_a, g_b (attention_in), o (attention_out)
    Mamba-2: in_proj (attention_in), [core], out_proj (attention_out)
    dense: w1, w3 (mlp_in), w2 (mlp_out); ungated relu^2 (Nemotron-H): w1 (mlp_in), w2 (mlp_out)
    MoE: router (router); routed experts w1, w3, w2 (relu^2: w1, w2; gpt-oss: gate_up, down), one grouped
         product each (or one product per local expert when the grouped GEMM does not apply); shared expert
         w1, w3, w2 (beside relu^2 experts: w1, w2); shared gate (router)

A recurrent mixer's chunked core re-runs whatever the save list: its products are neither kept nor counted
in the sequence (tessera/parallel/memory/recompute_policy.py). A layer of one sublayer (Nemotron-H) has only
its own. `alternate_matmuls` keeps the 1st, 3rd, ... of that sequence; `dispatch` keeps a MoE layer's all-to-all
outputs under ep > 1 (`kept_exchanges`). Outputs kept in FP8
(`parallel.activation_fp8`) take one byte per element and an fp32 scale per row.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.plan.activation_dtypes import ActivationDtype, get_activation_dtype
from tessera.plan.saved.saved_terms import SavedTensor, expert_rows, grouped_experts_apply, sdpa_core


@dataclass(frozen=True)
class Product:
    """One matrix product of a layer's forward on one process: output `per_token` elements of
    `itemsize` bytes, cut by tp as `split` says, in `rows` rows per token; its GEMM is
    [rows x tokens, k] x [k, n] (whole: tensor parallelism cuts n of the "tp" outputs and k of the
    attention_out / mlp_out ones), as `batch` equal products of rows / batch in one kernel."""

    name: str
    role: str
    per_token: float
    itemsize: int
    split: str
    rows: float
    k: float
    n: float
    batch: int = 1  # products in one kernel: the local experts of a grouped GEMM


def _linear(name: str, role: str, k: float, n: float, dt: ActivationDtype, split: str, rows: float = 1.0,
            itemsize: int | None = None) -> Product:
    return Product(name, role, rows * n, itemsize or dt.compute, split, rows, k, n)


def _attention(cfg: ModelConfig, dt: ActivationDtype) -> tuple[list[Product], list[Product]]:
    """(products before the core, products after it)."""
    h, a = cfg.dim, cfg.n_heads
    if cfg.mla is None:
        q, kv = a * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        wq = q * (2 if cfg.attention_output_gate else 1)
        return ([_linear("wq", "attention_in", h, wq, dt, "tp"), _linear("wk", "attention_in", h, kv, dt, "tp"),
                 _linear("wv", "attention_in", h, kv, dt, "tp")], [_linear("wo", "attention_out", q, h, dt, "rep")])
    m = cfg.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank is None:
        before = [_linear("wq", "attention_in", h, a * qk, dt, "tp")]
    else:
        before = [_linear("wq_a", "attention_in", h, m.q_lora_rank, dt, "rep"),
                  _linear("wq_b", "mla_up", m.q_lora_rank, a * qk, dt, "tp")]
    before += [_linear("wkv_a", "attention_in", h, m.kv_lora_rank + m.qk_rope_head_dim, dt, "rep"),
               _linear("wkv_b", "mla_up", m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim), dt, "tp")]
    return before, [_linear("wo", "attention_out", a * m.v_head_dim, h, dt, "rep")]


def _recurrent(cfg: ModelConfig, layer: int, dt: ActivationDtype) -> tuple[list[Product], list[Product]]:
    """A recurrent mixer's projections (before its chunked core, after it), in the order it runs them."""
    h = cfg.dim

    def into(name: str, n: float, k: float = h, split: str = "tp") -> Product:
        return _linear(name, "attention_in", k, n, dt, split)

    if cfg.is_mamba_layer(layer):
        m = cfg.mamba
        inner = m.n_heads * m.head_dim
        return [into("in_proj", 2 * inner + 2 * m.n_groups * m.state_size + m.n_heads)], [
            _linear("out_proj", "attention_out", inner, h, dt, "rep")]
    la = cfg.linear_attention
    K, HV, V = la.key_head_dim, la.n_value_heads, la.n_value_heads * la.value_head_dim
    if la.kind == "kda":
        hk = la.n_key_heads * K
        return ([into(n, hk) for n in ("q_proj", "k_proj", "v_proj")] + [
            into("f_a_proj", K, split="rep"), into("f_b_proj", hk, K), into("b_proj", la.n_key_heads)], [
            into("g_a_proj", K, split="rep"), into("g_b_proj", hk, K), _linear("o_proj", "attention_out", hk, h, dt,
                                                                              "rep")])
    qkv = 2 * la.n_key_heads * K + V
    before = ([into("in_proj_z", V), into("in_proj_qkv", qkv), into("in_proj_b", HV), into("in_proj_a", HV)]
              if la.projections == "split" else [into("in_proj_qkvz", qkv + V), into("in_proj_ba", 2 * HV)])
    return before, [_linear("out_proj", "attention_out", V, h, dt, "rep")]


# Each MLP's products in the order it runs them, by activation: (name, role, k, n) of the model dim h and the
# hidden dim f. gpt-oss's gate_up is gate and up interleaved in one product.
MLP_PRODUCTS = {"swiglu": lambda h, f: (("w1", "mlp_in", h, f), ("w3", "mlp_in", h, f), ("w2", "mlp_out", f, h)),
                "relu2": lambda h, f: (("w1", "mlp_in", h, f), ("w2", "mlp_out", f, h)),
                "clamped_swiglu": lambda h, f: (("gate_up", "mlp_in", h, 2 * f), ("down", "mlp_out", f, h))}


def _mlp(prefix: str, h: int, f: int, dt: ActivationDtype, rows: float = 1.0, experts: int = 1,
         grouped: bool = True, activation: str = "swiglu") -> list[Product]:
    """An MLP's products (MLP_PRODUCTS[activation]) over `experts` experts (balanced rows): one grouped
    product per weight, or one product per expert (the loop)."""
    out = []
    for name, role, k, n in MLP_PRODUCTS[activation](h, f):
        # gate/up outputs cut over F (gpt-oss's experts are whole on each tp rank); down outputs are partial sums
        split = "tp" if role == "mlp_in" and activation != "clamped_swiglu" else "rep"
        if grouped:
            out.append(Product(f"{prefix}.{name}", role, rows * n, dt.compute, split, rows, k, n, experts))
        else:
            out += [_linear(f"{prefix}.{name}", role, k, n, dt, split, rows / experts)] * experts
    return out


def layer_products(cfg: ModelConfig, layer: int, dtype: str = "bf16", *, tokens: int = 4096,
                   local_experts: int | None = None) -> tuple[list[Product], list[Product]]:
    """The layer's matrix products in the order the block runs them: (before the attention core,
    after it). `local_experts`: routed experts on this rank (default: all)."""
    dt = get_activation_dtype(dtype)
    h = cfg.dim
    kind = None if cfg.sublayers is None else cfg.sublayers[layer]
    if kind == "mlp":
        return [], _dense(cfg, dt)
    if cfg.is_linear_attention_layer(layer) or cfg.is_mamba_layer(layer):
        before, after = _recurrent(cfg, layer, dt)
    else:
        before, after = _attention(cfg, dt) if kind != "moe" else ([], [])
    if kind in ("mamba", "attention"):
        return before, after
    if not cfg.is_moe_layer(layer):
        return before, after + _dense(cfg, dt)
    e = cfg.moe
    local = local_experts or e.num_experts
    rows = expert_rows(cfg, tokens)
    after.append(_linear("router", "router", h, e.num_experts, dt, "seq", itemsize=4))
    after += _mlp("experts", h, e.ffn_dim, dt, rows, local, grouped_experts_apply(cfg, dt), e.expert_activation)
    if e.shared_ffn_dim > 0:  # SwiGLU, or relu^2 beside relu^2 experts (models/moe/layer.py)
        after += _mlp("shared", h, e.shared_ffn_dim, dt, activation="relu2" if e.expert_activation == "relu2"
                      else "swiglu")
        if e.shared_expert_gate:
            after.append(_linear("shared_gate", "router", h, 1, dt, "seq"))
    return before, after


def _dense(cfg: ModelConfig, dt: ActivationDtype) -> list[Product]:
    """The dense MLP's products: SwiGLU's three, or the ungated relu^2's up and down."""
    return _mlp("feed_forward", cfg.dim, cfg.ffn_dim, dt, activation="relu2" if cfg.activation == "relu2" else "swiglu")


def kept_products(products: list[Product], save: tuple[str, ...], fp8: tuple[str, ...]
                  ) -> tuple[list[Product], list[Product], list[Product]]:
    """(kept whole, kept in FP8, recomputed) for a save list and FP8 roles (recompute_policy.py's rule)."""
    kept, in_fp8, recomputed = [], [], []
    for i, p in enumerate(products):
        if p.role in fp8:
            in_fp8.append(p)
        elif "matmuls" in save or p.role in save or ("alternate_matmuls" in save and i % 2 == 0):
            kept.append(p)
        else:
            recomputed.append(p)
    return kept, in_fp8, recomputed


def attention_core_outputs(cfg: ModelConfig, dtype: str) -> list[SavedTensor]:
    """The attention kernel's outputs: its output in the compute dtype and the fp32 log-sum-exp per head."""
    dt = get_activation_dtype(dtype)
    v = cfg.head_dim if cfg.mla is None else cfg.mla.v_head_dim
    return [SavedTensor("core.out", cfg.n_heads * v, dt.compute, "tp"), SavedTensor("core.logsumexp", cfg.n_heads,
                                                                                   4, "tp")]


def op_saved_tensors(cfg: ModelConfig, layer: int, dtype: str, save: tuple[str, ...], fp8: tuple[str, ...] = (),
                     *, tokens: int = 4096, local_experts: int | None = None,
                     core_kept: bool = True, dispatch_dtype: str = "input") -> list[SavedTensor]:
    """What layer `layer` keeps under `recompute=op` with save list `save` and FP8 roles `fp8`:
    its input, the kept products' outputs (FP8 ones at one byte plus a scale per row) and, when
    `attention_core` is saved and the core is an SDPA kernel (`core_kept`, and no sinks: `sdpa_core`), the
    core's outputs."""
    dt = get_activation_dtype(dtype)
    before, after = layer_products(cfg, layer, dtype, tokens=tokens, local_experts=local_experts)
    kept, in_fp8, _ = kept_products(before + after, save, fp8)
    out = [SavedTensor("layer.input", cfg.dim, dt.residual, "seq")]
    out += [SavedTensor(p.name, p.per_token, p.itemsize, p.split) for p in kept]
    for p in in_fp8:
        out += [SavedTensor(f"{p.name}.fp8", p.per_token, 1, p.split), SavedTensor(f"{p.name}.scale", p.rows, 4, "rep")]
    if "attention_core" in save and core_kept and sdpa_core(cfg, layer):  # (a recurrent or sink core re-runs)
        out += attention_core_outputs(cfg, dtype)
    if ("dispatch" in save or "dispatch" in fp8) and cfg.is_moe_layer(layer) and local_experts is not None \
            and local_experts < cfg.moe.num_experts:
        out += kept_exchanges(cfg, dtype, tokens, fp8="dispatch" in fp8, dispatch_dtype=dispatch_dtype)
    return out


def kept_exchanges(cfg: ModelConfig, dtype: str, tokens: int, fp8: bool = False,
                   dispatch_dtype: str = "input") -> list[SavedTensor]:
    """What a MoE layer keeps of its expert all-to-alls under `dispatch` (ep > 1:
    tessera/parallel/memory/kept_exchange.py): the dispatched rows it received (the MoE input's dtype,
    the residual's) and the combined rows that came back (the experts' output, the compute dtype), each
    the experts' rows per token (balanced routing), or with `fp8` both at one byte plus an fp32 scale
    per row; and the per-expert counts it sent and received. `dispatch_dtype` compute: the dispatched
    rows arrive in the compute dtype (parallel.ep_dispatch_dtype)."""
    dt = get_activation_dtype(dtype)
    rows = expert_rows(cfg, tokens)
    counts = SavedTensor("moe.kept.counts", 0, 8, "rep", fixed=2 * cfg.moe.num_experts)
    if fp8:
        return [*(SavedTensor(f"moe.kept.{name}{part}", n, size, "rep") for name in ("dispatched", "combined")
                  for part, n, size in ((".fp8", rows * cfg.dim, 1), (".scale", rows, 4))), counts]
    sent = dt.compute if dispatch_dtype == "compute" else dt.residual
    return [SavedTensor("moe.kept.dispatched", rows * cfg.dim, sent, "rep"),
            SavedTensor("moe.kept.combined", rows * cfg.dim, dt.compute, "rep"), counts]


def recomputed_products(cfg: ModelConfig, layer: int, dtype: str, save: tuple[str, ...], fp8: tuple[str, ...],
                        *, tokens: int = 4096, local_experts: int | None = None) -> list[Product]:
    """The products `recompute=op` runs again in backward (neither kept nor kept in FP8)."""
    before, after = layer_products(cfg, layer, dtype, tokens=tokens, local_experts=local_experts)
    return kept_products(before + after, save, fp8)[2]


def product_flops_per_token(p: Product) -> float:
    """Forward FLOPs of product `p` per token of the micro-batch (whole, before tensor parallelism)."""
    return 2.0 * p.rows * p.k * p.n
