"""Which kernel runs a recurrent mixer's core and its short convolution: Tessera's PyTorch forms (the
reference, on every device), or on CUDA the maintained libraries' kernels behind the same calls.

Each mixer (Gated DeltaNet, Kimi delta attention, Mamba-2) asks `kernels_for(self, x, kind)` at its
first call and keeps the answer in its `kernels` attribute (a `RecurrentKernels`) until it is called on
another device type (`choose_again(model)` forgets every mixer's answer). The answer:

- CPU, or any device but CUDA: the PyTorch forms (delta_rule.py, ssd.py); where the serving engine has
  filled a delta-rule mixer's `fused_chunk_terms` (tessera/infer/cpu/layer_ops.py) its chunked form takes
  the C++ library's chunk terms (`kernel_choice` says so).
- CUDA, where the library imports: flash-linear-attention (`fla-core`) for the gated delta rule
  (`chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule`) and Kimi delta attention (`chunk_kda`,
  `fused_recurrent_kda`); mamba-ssm for SSD (`mamba_chunk_scan_combined`, `selective_state_update`);
  the convolution from causal-conv1d (`causal_conv1d_fn`, `causal_conv1d_update` for a decode token)
  where it imports, else flash-linear-attention's `causal_conv1d`. A library that does not import is
  said once in the log, naming its pip package, and the PyTorch form runs in its place.
- `TESSERA_RECURRENT_KERNELS=torch`: the PyTorch forms everywhere (read at each choice).

The libraries' conventions, as the calls below meet them: inputs [B, S, H, .] as Tessera has them, q
and k of the gated delta rule per key head, each serving consecutive value heads (fla's grouped values);
q and k L2-normalised in the kernel (`use_qk_l2norm_in_kernel`, eps 1e-6 inside the root, as the
reference) and q scaled by K^-0.5 (the default `scale`); g the log-decay (<= 0) in fp32, [B, S, H] per
head or [B, S, H, K] per channel, beta already a sigmoid; start and final states fp32 [B, H, K, V] (fla's
default layout, `state_v_first=False`) or [B, H, P, N] (mamba-ssm's); dt already the step size
(softplus, bias and dt_min applied by `step_sizes`), so mamba-ssm gets no dt_bias / softplus / limit;
D applied in the kernel, the gate z left to the layer's norm. causal-conv1d wants channels-last
[B, C, S] with C a multiple of 8 and width 2 to 4 (else the convolution stays PyTorch's) and its
states [B, C, W-1] channels-last; fla's convolution keeps W inputs per channel, the first unread.
Outputs come back in v's (x's) dtype with fp32 states, as the reference's. The fused recurrent
kernels and `causal_conv1d_update` have no backward: where a gradient is wanted they leave the token
to the PyTorch form (decoding wants none). Under context parallelism (a `handoff`) the core stays the
PyTorch form (handoff.py runs it over [v | 0] from [0 | I]). Under torch.compile the libraries' calls run
outside the compiled graphs (`torch.compiler.disable`: their own autograd Functions and Triton / CUDA
kernels), a graph break at each.
Shapes: B batch, S sequence, H heads, K key dim, V value dim, P head dim, G groups, N state size,
C channels, W conv width.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.errors import ModelError
from tessera.models.linear_attention.delta_rule import causal_conv, recurrent_delta_rule
from tessera.models.linear_attention.ssd import recurrent_ssd

log = logging.getLogger("tessera.models")

ENV = "TESSERA_RECURRENT_KERNELS"  # "torch": the PyTorch forms on every device
REFERENCE = "pytorch"
KINDS = ("gated_delta_rule", "kda", "ssd")
MISSING: set[str] = set()  # the pip packages said missing in the log (once each)


@dataclass(frozen=True)
class Library:
    """A maintained library's kernels: its name, the pip requirement that installs it, and the
    (module, function) pairs Tessera calls."""

    label: str
    package: str
    functions: tuple[tuple[str, str], ...]


FLA_GATED_DELTA_RULE = Library("flash-linear-attention", "fla-core==0.6.0", (
    ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule")))
FLA_KDA = Library("flash-linear-attention", "fla-core==0.6.0", (
    ("fla.ops.kda", "chunk_kda"), ("fla.ops.kda", "fused_recurrent_kda")))
FLA_CONV = Library("flash-linear-attention", "fla-core==0.6.0", (("fla.modules.causal_conv1d", "causal_conv1d"),))
CAUSAL_CONV1D = Library("causal-conv1d", "causal-conv1d==1.7.0", (
    ("causal_conv1d", "causal_conv1d_fn"), ("causal_conv1d", "causal_conv1d_update")))
MAMBA_SSD = Library("mamba-ssm", "mamba-ssm==2.3.2.post1", (
    ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")))
CORES = {"gated_delta_rule": FLA_GATED_DELTA_RULE, "kda": FLA_KDA, "ssd": MAMBA_SSD}

# (x [B, C, S], weight [C, W], earlier inputs [B, C, W-1] or None, bias [C] or None) -> (SiLU output, new state)
Conv = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# the delta rule's (q, k, v, g, beta, start state) or SSD's (x, dt, A, B, C, D, start state, chunk=)
# -> (output, final state), as delta_rule.py's and ssd.py's forms
Core = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RecurrentKernels:
    """What runs one mixer: `core` and `conv` name them; `chunked` / `recurrent` None where the
    layer's own PyTorch form runs; `device` the device type chosen for."""

    device: str
    core: str = REFERENCE
    conv_name: str = REFERENCE
    conv: Conv = causal_conv
    chunked: Core | None = None
    recurrent: Core | None = None

    def describe(self, chunk_terms: bool = False) -> str:
        core = self.core
        if core == REFERENCE and chunk_terms:
            core = f"{REFERENCE} with the CPU library's chunk terms (tessera_cpu.delta_chunk_terms, no gradients)"
        return f"{self.device}: core {core}; conv {self.conv_name}"


@functools.cache
def loaded(library: Library) -> tuple[Callable, ...] | None:
    """The library's functions, or None where it does not import here, said once per pip package in
    the log (`_missing`)."""
    try:
        return tuple(getattr(importlib.import_module(module), name) for module, name in library.functions)
    except Exception as e:  # not installed, or its compiled part does not load: the PyTorch forms serve
        _missing(library.label, library.package, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None


def _missing(label: str, package: str, reason: str) -> None:
    if package not in MISSING:
        MISSING.add(package)
        log.warning("%s is not importable here (%s); Tessera's PyTorch forms run in place of its kernels on CUDA "
                    "(pip install %s provides them)", label, reason, package)


def choose(kind: str, device: torch.device | str) -> RecurrentKernels:
    """The kernels for a mixer of `kind` ("gated_delta_rule", "kda" or "ssd") on `device` (module
    docstring). Imports a library only for CUDA."""
    device = torch.device(device)
    if kind not in CORES:
        raise ModelError(f"kind={kind!r} is invalid: one of {', '.join(KINDS)}")
    if os.environ.get(ENV, "").lower() == "torch":
        return RecurrentKernels(device.type, f"{REFERENCE} ({ENV}=torch)", f"{REFERENCE} ({ENV}=torch)")
    if device.type != "cuda":
        return RecurrentKernels(device.type)
    conv_name, conv = _cuda_conv()
    library = CORES[kind]
    functions = loaded(library)
    if functions is None:
        return RecurrentKernels("cuda", conv_name=conv_name, conv=conv)
    chunked, recurrent = (_ssd_forms if kind == "ssd" else _delta_rule_forms)(*functions)
    names = " / ".join(name for _, name in library.functions)
    return RecurrentKernels("cuda", f"{library.label} {names}", conv_name, conv, torch.compiler.disable(chunked),
                            torch.compiler.disable(recurrent))


def kernels_for(mixer: nn.Module, x: torch.Tensor, kind: str) -> RecurrentKernels:
    """The mixer's kernels for input `x`: chosen at its first call (or first call on another device
    type) and kept in its `kernels` attribute."""
    chosen = mixer.kernels
    if chosen is None or chosen.device != x.device.type:
        chosen = mixer.kernels = choose(kind, x.device)
    return chosen


def kernel_choice(mixer: nn.Module) -> str:
    """What runs `mixer` (for logs and tests): its device, core and convolution, or that it has not
    been called yet."""
    if mixer.kernels is None:
        return "not chosen yet (chosen at the first call)"
    return mixer.kernels.describe(getattr(mixer, "fused_chunk_terms", None) is not None)


def choose_again(model: nn.Module) -> int:
    """Forget every recurrent mixer's choice (their next call chooses anew, reading the environment
    again); returns how many forgot one."""
    n = 0
    for module in model.modules():
        if isinstance(getattr(module, "kernels", None), RecurrentKernels):
            module.kernels = None
            n += 1
    return n


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _delta_rule_forms(chunk_fn: Callable, recurrent_fn: Callable) -> tuple[Core, Core]:
    """The gated delta rule (a decay per head or per key channel) through flash-linear-attention's
    chunked and fused recurrent kernels, called as delta_rule.py's forms are."""

    def call(fn: Callable, q, k, v, g, beta, state):
        dtype = v.dtype
        out, final = fn(q=q.to(dtype), k=k.to(dtype), v=v, g=g.float(), beta=beta.to(dtype),
                        initial_state=None if state is None else state.float(), output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        return out.to(dtype), final.float()

    def chunked(q, k, v, g, beta, state=None):
        return call(chunk_fn, q, k, v, g, beta, state)

    def recurrent(q, k, v, g, beta, state=None):
        if _wants_grad(q, k, v, g, beta, state):  # (the fused recurrent kernels have no backward)
            group = v.shape[2] // q.shape[2]  # the PyTorch form takes q and k per value head
            return recurrent_delta_rule(q.repeat_interleave(group, 2), k.repeat_interleave(group, 2), v, g, beta, state)
        return call(recurrent_fn, q, k, v, g, beta, state)

    return chunked, recurrent


def _ssd_chunk(chunk: int) -> int:
    """mamba-ssm's chunk length: the layer's where it is a power of two of at least 16 (its Triton
    tiles), else 64; the result does not depend on it."""
    return chunk if chunk >= 16 and chunk & (chunk - 1) == 0 else 64


def _ssd_forms(chunk_scan: Callable, state_update: Callable) -> tuple[Core, Core]:
    """SSD through mamba-ssm's chunked scan and its one-token state update, called as ssd.py's forms."""

    def chunked(x, dt, A, Bm, Cm, D, state=None, chunk: int = 128):
        y, final = chunk_scan(x.contiguous(), dt.float().contiguous(), A.float().contiguous(), Bm.to(x.dtype),
                              Cm.to(x.dtype), _ssd_chunk(chunk), D=D.float().contiguous(),
                              initial_states=None if state is None else state.float().contiguous(),
                              return_final_states=True)
        return y.to(x.dtype), final.float()

    def recurrent(x, dt, A, Bm, Cm, D, state=None):
        if _wants_grad(x, dt, A, Bm, Cm, D, state):  # (the state update has no backward)
            return recurrent_ssd(x, dt, A, Bm, Cm, D, state)
        Bn, S, H, P = x.shape
        N = Bm.shape[-1]
        st = x.new_zeros(Bn, H, P, N, dtype=torch.float32) if state is None else state.float().clone()
        # per (head, channel) as the kernel takes them, stride 0 along P and N (its tied-head-dim path)
        A_HPN = A.float()[:, None, None].expand(H, P, N)
        D_HP, no_bias = D.float()[:, None].expand(H, P), x.new_zeros(H, 1, dtype=torch.float32).expand(H, P)
        ys = [state_update(st, x[:, t], dt[:, t].float()[..., None].expand(Bn, H, P), A_HPN, Bm[:, t].to(x.dtype),
                           Cm[:, t].to(x.dtype), D=D_HP, dt_bias=no_bias, dt_softplus=False) for t in range(S)]
        return torch.stack(ys, dim=1).to(x.dtype), st

    return chunked, recurrent


def _cuda_conv() -> tuple[str, Conv]:
    """The short convolution on CUDA: causal-conv1d's where it imports, else flash-linear-attention's,
    else PyTorch's."""
    functions = loaded(CAUSAL_CONV1D)
    if functions is not None:
        return ("causal-conv1d causal_conv1d_fn / causal_conv1d_update",
                torch.compiler.disable(_causal_conv1d_form(*functions)))
    functions = loaded(FLA_CONV)
    if functions is not None:
        return "flash-linear-attention causal_conv1d", torch.compiler.disable(_fla_conv_form(*functions))
    return REFERENCE, causal_conv


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """[B, C, L] with the channels adjacent in memory (stride 1), as causal-conv1d's states need."""
    return t if t.stride(1) == 1 else t.transpose(1, 2).contiguous().transpose(1, 2)


def _causal_conv1d_form(conv_fn: Callable, update_fn: Callable) -> Conv:
    def conv(x_BCS: torch.Tensor, weight_CW: torch.Tensor, state_BCw: torch.Tensor | None,
             bias_C: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        C, W = weight_CW.shape
        if C % 8 or not 2 <= W <= 4:  # outside what its kernels take
            return causal_conv(x_BCS, weight_CW, state_BCw, bias_C)
        dtype = x_BCS.dtype
        weight = weight_CW.to(dtype).contiguous()
        bias = None if bias_C is None else bias_C.to(dtype).contiguous()
        if x_BCS.shape[-1] == 1 and state_BCw is not None and not _wants_grad(x_BCS, weight, bias, state_BCw):
            state = state_BCw.to(dtype).contiguous().clone()  # (updated in place: the caller's stays as it was)
            return update_fn(x_BCS, state, weight, bias, activation="silu"), state
        start = None if state_BCw is None else _channels_last(state_BCw.to(dtype))
        out, final = conv_fn(_channels_last(x_BCS), weight, bias, initial_states=start, return_final_states=True,
                             activation="silu")
        return out, final

    return conv


def _fla_conv_form(conv_fn: Callable) -> Conv:
    def conv(x_BCS: torch.Tensor, weight_CW: torch.Tensor, state_BCw: torch.Tensor | None,
             bias_C: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = x_BCS.dtype
        start = None if state_BCw is None else F.pad(state_BCw.to(dtype), (1, 0))  # [B, C, W]: fla keeps W inputs
        y, final = conv_fn(x=x_BCS.transpose(1, 2), weight=weight_CW.to(dtype),
                           bias=None if bias_C is None else bias_C.to(dtype), initial_state=start,
                           output_final_state=True, activation="silu")
        return y.transpose(1, 2), final[..., 1:]

    return conv
