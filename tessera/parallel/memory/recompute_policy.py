"""Operator-level recomputation (`parallel.recompute=op`): a block re-runs in backward except the
operators whose outputs `parallel.recompute_save` names; those outputs are kept from the forward.

This is torchtitan's selective "op" policy generalised: PyTorch's selective activation checkpoint
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) runs the block under a dispatch mode
that asks a policy, operator by operator, whether to keep the output; backward replays the block's
forward, taking kept outputs from that cache and recomputing the rest. The policy here decides by
what an operator is and where it runs:

- the attention kernel (an SDPA operator inside the attention core seam) -> `attention_core`;
- a matrix product (mm, addmm, bmm, grouped mm, FP8 scaled mm) outside the core -> its role, from the
  module running it (`ROLES`: q/k/v are attention_in, MLA's wq_b/wkv_b mla_up, wo attention_out, the
  router and shared-expert gate router, SwiGLU gate/up mlp_in and down mlp_out, relu^2's up mlp_in and
  down mlp_out; the routed experts, the MoE's `experts` whatever their activation, multiply by their
  weights in turn (`expert_weights`: SwiGLU's gate, up, down; relu^2's up, down; gpt-oss's gate_up,
  down), each as one grouped product or one product per local expert (the loop; under ep this rank's
  experts), and the products by every weight but the last are mlp_in, by the last, down, mlp_out) and
  its place in the block's sequence of products (`alternate_matmuls` keeps the 1st, 3rd, 5th ...,
  torchtitan's rule);
- a hybrid model's recurrent mixer (Gated DeltaNet, Kimi delta attention, Mamba-2): its projections take
  roles as attention's do (those into the mixer attention_in, the one out of it attention_out; under tp the
  ones it runs outside their modules, F.linear of what its `own_part` seam reads, by the weight read), and its
  chunked core, whose products are the form's own chunk terms and not one kernel whose outputs could be
  kept, re-runs whatever the save list (its products neither kept nor counted among the block's);
- everything else (norms, RoPE, casts, activations, routing, dispatch, collectives) re-runs, except
  that with `dispatch` saved the expert all-to-alls of the replay take the forward's received rows
  (and counts) instead of sending again (kept_exchange.py): backward sends only the gradients.

`parallel.activation_fp8` keeps the outputs of the named roles in FP8 (E4M3, one fp32 scale per
row) instead: the forward computes with the exact output, the replay in backward receives the FP8
copy dequantized and recomputes what follows from it (DeepSeek-V3, arXiv 2412.19437 section 3.3.3,
caches the SwiGLU inputs in FP8 and recomputes the SwiGLU output). That path needs one more dispatch
mode, `_Classifier`, below PyTorch's caching mode: it sees every operator with its output, decides,
stores the FP8 copy, and in the replay answers the FP8 operators from that store in their order.

A block's forward is the same operators in the same order every time (the checkpoint relies on it),
so the classification of the replay matches the forward's. `observe` hands every kept output (and
FP8 copy) to a callback: the planner's tests count them as the bytes this policy keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tessera.models.attention import Attention
from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet, whole
from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
from tessera.models.linear_attention.mamba2 import Mamba2Mixer
from tessera.models.mla import MultiHeadLatentAttention
from tessera.models.mlp import FeedForward, PlainFeedForward
from tessera.models.moe.layer import MoE
from tessera.parallel.memory.kept_exchange import ExchangeRecord, Keeping

aten = torch.ops.aten
MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default}
GROUPED_MM = aten._grouped_mm.default if hasattr(aten, "_grouped_mm") else None
if GROUPED_MM is not None:
    MATMUL_OPS.add(GROUPED_MM)
ATTENTION_OPS = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(aten, name)}
E4M3 = torch.float8_e4m3fn
_AMAX_FLOOR = 1e-12

# The role of each matrix product, by the module that runs it (its attribute name in its parent).
ROLES = {Attention: {"wq": "attention_in", "wk": "attention_in", "wv": "attention_in", "wo": "attention_out"},
         MultiHeadLatentAttention: {"wq": "attention_in", "wq_a": "attention_in", "wkv_a": "attention_in",
                                    "wq_b": "mla_up", "wkv_b": "mla_up", "wo": "attention_out"},
         FeedForward: {"w1": "mlp_in", "w3": "mlp_in", "w2": "mlp_out"},
         PlainFeedForward: {"w1": "mlp_in", "w2": "mlp_out"},
         MoE: {"router": "router", "shared_gate": "router"},
         GatedDeltaNet: {**dict.fromkeys(("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b",
                                           "in_proj_a"), "attention_in"), "out_proj": "attention_out"},
         KimiDeltaAttention: {**dict.fromkeys(("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj",
                                                "g_a_proj", "g_b_proj"), "attention_in"), "o_proj": "attention_out"},
         Mamba2Mixer: {"in_proj": "attention_in", "out_proj": "attention_out"}}
RECURRENT_MIXERS = (GatedDeltaNet, KimiDeltaAttention, Mamba2Mixer)
# Under tensor parallelism a recurrent mixer runs some projections outside their modules, as F.linear of
# what its `own_part` seam reads (Qwen3.5's in_proj_qkv, Mamba-2's in_proj): their role, by the weight read.
SEAM_READS = {GatedDeltaNet: {"qkv": "attention_in"}, Mamba2Mixer: {"in_proj": "attention_in"}}
CORE = "attention_core"
RECURRENT_CORE = "recurrent_core"  # a recurrent mixer's scope: what runs in it outside its projections
DISPATCH = "dispatch"  # the MoE exchanges' received rows and counts (kept_exchange.py)
EXPERTS = "experts"  # mlp_in or mlp_out by the weight multiplied (module docstring)


def expert_weights(experts: nn.Module) -> list[str]:
    """The routed experts' weight matrices ([E, out, in], named in their `split_dims`; not gpt-oss's [E, out]
    biases), which they multiply by in turn, the down one last: SwiGLU's gate, up and down, relu^2's up and
    down, gpt-oss's gate_up and down. The quantized experts keep GroupedExperts' three as codes under other names."""
    return [n for n in experts.split_dims if getattr(experts, n, None) is None or getattr(experts, n).dim() == 3]


def fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` [..., n] in E4M3 with one fp32 scale per row (its amax onto E4M3's largest value)."""
    fmax = torch.finfo(E4M3).max
    scale = fmax / t.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=_AMAX_FLOOR)
    return (t.float() * scale).clamp(-fmax, fmax).to(E4M3), scale.reciprocal()


def from_fp8_rows(q: torch.Tensor, inverse_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * inverse_scale).to(dtype)


class _Forward:
    """What one forward of a block records for its replay: its counters and, per product or
    attention operator not kept, its FP8 copy or None, in order."""

    def __init__(self) -> None:
        self.products = 0  # matrix products so far (alternate_matmuls)
        self.expert_weights = 0  # weights the routed experts' current call has begun to multiply by
        self.expert_left = 0  # ... and the products left of the last one (one grouped, or one per local expert)
        self.replay: list[tuple[torch.Tensor, torch.Tensor, torch.dtype] | None] = []
        self.position = 0  # the replay's place in `replay`
        self.pending: dict = {}  # operator -> decision, from the classifier to the policy
        self.seam_role: str | None = None  # the next product's role, read through a mixer's own_part (SEAM_READS)


class BlockOpPolicy:
    """What one block keeps under `recompute=op`: `save` (RECOMPUTE_SAVE_CHOICES) and `fp8`
    (ACTIVATION_FP8_CHOICES). `install(block)` marks the modules whose products have a role;
    `context()` is the checkpoint's `context_fn`, called once per forward of the block (several
    forwards may wait for their backward: each has its own record)."""

    def __init__(self, save: Iterable[str], fp8: Iterable[str] = ()):
        self.save, self.fp8 = frozenset(save), frozenset(fp8)
        self.keep_all = "matmuls" in self.save
        self.alternate = "alternate_matmuls" in self.save
        self.scopes: list[tuple[str, nn.Module | None]] = []  # (role, module), innermost last
        self.observers: list[Callable[[torch.Tensor], None]] = []  # measurement (module docstring)
        self.current = _Forward()

    # ---- where an operator runs ----------------------------------------------------------------
    def install(self, block: nn.Module) -> None:
        """Scope hooks on the block's role modules and on its attention core seam."""
        for module in block.modules():
            for kind, names in ROLES.items():
                if isinstance(module, kind):
                    for name, role in names.items():
                        child = getattr(module, name, None)
                        if isinstance(child, nn.Module):
                            self._scope(child, role)
            if isinstance(module, MoE):  # its routed experts, whatever their activation (SwiGLU, relu^2, gpt-oss's)
                self._scope(module.experts, EXPERTS)
            if isinstance(module, RECURRENT_MIXERS):
                self._scope(module, RECURRENT_CORE)
                roles = SEAM_READS.get(type(module), {})
                if roles and module.own_part is not whole:  # (whole: the modules run their own products)
                    module.own_part = _RoleReads(module.own_part, self, roles)
            if isinstance(module, (Attention, MultiHeadLatentAttention)):
                module.attention_core = _ScopedCore(module.attention_core, self)

    def _scope(self, module: nn.Module, role: str) -> None:
        def enter(mod, args):
            self.scopes.append((role, mod))
            if role == EXPERTS:
                self.current.expert_weights = self.current.expert_left = 0

        def leave(mod, args, out):
            if self.scopes and self.scopes[-1][1] is mod:
                self.scopes.pop()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    def _role(self, func) -> str | None:
        """The role of a matrix product at this point of the forward (None: none)."""
        if not self.scopes:
            return None
        role, module = self.scopes[-1]
        if role != EXPERTS:
            return role
        r, weights = self.current, expert_weights(module)
        if r.expert_left == 0:  # the first product by the next weight: one grouped product, or one per local expert
            r.expert_weights += 1
            r.expert_left = 1 if func is GROUPED_MM else module.local_weight(getattr(module, weights[0])).shape[0]
        r.expert_left -= 1
        return "mlp_in" if r.expert_weights < len(weights) else "mlp_out"  # the last weight multiplied: down

    # ---- the decision --------------------------------------------------------------------------
    def classify(self, func) -> str:
        """'keep', 'fp8' or 'recompute' for the next product or attention operator, in forward order."""
        in_core = any(role == CORE for role, _ in self.scopes)
        if func in ATTENTION_OPS:
            return "keep" if in_core and CORE in self.save else "recompute"
        seam_role, self.current.seam_role = self.current.seam_role, None
        if in_core or (seam_role is None and self.scopes and self.scopes[-1][0] == RECURRENT_CORE):
            return "recompute"  # products inside a core of its own (ring attention, a recurrent mixer's): it re-runs
        role = seam_role or self._role(func)
        self.current.products += 1
        if role is not None and role in self.fp8:
            return "fp8"
        if self.keep_all or (role is not None and role in self.save):
            return "keep"
        return "keep" if self.alternate and self.current.products % 2 == 1 else "recompute"

    def context(self):
        """The checkpoint's context_fn: (forward context, recompute context) of one forward."""
        record = self.current = _Forward()
        caching, cached = create_selective_checkpoint_contexts(self._policy)
        forward = [_Classifier(self, record, replay=False), caching, _ProfilerPassThrough()]
        replay = [_Classifier(self, record, replay=True), _Rewound(cached), _ProfilerPassThrough()]
        if DISPATCH in self.save or DISPATCH in self.fp8:  # the expert exchanges' outputs kept (kept_exchange.py)
            exchanges = ExchangeRecord(self.observers, **({"pack": fp8_rows, "unpack": from_fp8_rows}
                                                          if DISPATCH in self.fp8 else {}))
            forward.append(Keeping(exchanges, replay=False))
            replay.append(Keeping(exchanges, replay=True))
        return _Stack(*forward), _Stack(*replay)

    def _policy(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        decision = self.current.pending.pop(func, "recompute")
        return CheckpointPolicy.MUST_SAVE if decision == "keep" else CheckpointPolicy.PREFER_RECOMPUTE


class _ScopedCore:
    """The attention core seam, marked as the core's scope for the policy (nothing else changes)."""

    def __init__(self, inner: Callable, policy: BlockOpPolicy):
        self.inner, self.policy = inner, policy

    def __call__(self, *args, **kwargs):
        self.policy.scopes.append((CORE, None))
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.policy.scopes.pop()


class _RoleReads:
    """A recurrent mixer's `own_part` seam under tensor parallelism: a read of a projection's weight (or bias)
    gives the product that follows, its F.linear, that projection's role (SEAM_READS)."""

    def __init__(self, inner: Callable, policy: BlockOpPolicy, roles: dict[str, str]):
        self.inner, self.policy, self.roles = inner, policy, roles

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name in self.roles:
            self.policy.current.seam_role = self.roles[name]
        return self.inner(name, t)

    def __getattr__(self, name: str):  # the rank part's own attributes (its `cut`, its spans)
        return getattr(self.inner, name)


class _Classifier(TorchDispatchMode):
    """Below PyTorch's caching mode in forward: classifies each product and attention operator as it
    runs (handing the decision to the policy), keeps FP8 copies, shows kept outputs to observers.
    In the replay, below the cached mode, which passes down only the operators it does not hold:
    answers the FP8 products from their copies, in order, and runs the rest."""

    def __init__(self, policy: BlockOpPolicy, record: _Forward, replay: bool):
        super().__init__()
        self.policy, self.record, self.replay = policy, record, replay

    def __enter__(self):
        if self.replay:  # every replay starts from the forward's first product (see _Rewound)
            self.record.position = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched = func in MATMUL_OPS or func in ATTENTION_OPS
        r = self.record
        if self.replay:
            if watched and r.position < len(r.replay):
                entry = r.replay[r.position]
                r.position += 1
                if entry is not None:
                    return from_fp8_rows(*entry)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not watched:
            return out
        decision = r.pending[func] = self.policy.classify(func)
        observers = self.policy.observers
        if decision == "keep":
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    for observe in observers:
                        observe(t)
        elif decision == "fp8":
            q, inverse = fp8_rows(out)
            r.replay.append((q, inverse, out.dtype))
            for observe in observers:
                observe(q)
                observe(inverse)
        else:
            r.replay.append(None)
        return out


class _Rewound:
    """PyTorch's cached mode, whose store every replay finds whole: the cached mode hands each kept
    output out once, while a split backward (the input pass, then the weight pass: zero_bubble, zbv,
    DualPipeV) replays the block once per pass. The store (the shared `storage` of
    `create_selective_checkpoint_contexts`) is copied at the first replay and restored before each
    later one; the kept outputs live until the block's graph is freed, as the second pass needs."""

    def __init__(self, cached: TorchDispatchMode):
        self.cached = cached
        self.whole: dict | None = None

    def __enter__(self):
        storage = self.cached.storage
        if self.whole is None:
            self.whole = {key: dict(entries) for key, entries in storage.items()}
        else:
            for key, entries in self.whole.items():
                storage[key] = dict(entries)
        return self.cached.__enter__()

    def __exit__(self, *exc):
        return self.cached.__exit__(*exc)


class _ProfilerPassThrough(TorchDispatchMode):
    """Above PyTorch's caching modes: profiler ranges (record_function) run outside them. Their number
    may differ between the forward and the replay (FSDP2 marks its hooks with them, and a module
    sharded inside the block, the routed experts under ep, runs its pre-forward differently in the
    replay), while the cached mode expects every operator of the replay to have run in the forward."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "profiler":
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class _Stack:
    """Enter context managers in order and leave them in reverse."""

    def __init__(self, *contexts):
        self.contexts = contexts

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        return False
