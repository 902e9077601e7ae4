"""The CUDA libraries' kernels behind the recurrent mixers (tessera/models/linear_attention/cuda_kernels.py)
against Tessera's PyTorch forms, the reference (marked `gpu`: skipped where CUDA is absent, and each
test where its library is not installed; docs/models.md says how a GPU session carries them).

As in test_cuda_training.py, CUDA runs only in spawned children; they return the errors as plain
numbers: the largest difference relative to the reference's largest value. Each kernel is compared on
inputs in the dtype it runs in (fp32, bf16) with the reference computing from the same values in fp32:
- flash-linear-attention's gated delta rule (q and k grouped over the value heads, as Qwen3-Next's) and
  KDA kernels, chunked (150 tokens: two chunks of 64 and a part) and fused recurrent (1 and 9 tokens),
  from a zero state and from a given one, outputs and final states, and in fp32 the chunked kernel's
  gradients;
- mamba-ssm's chunked SSD scan and its one-token state update, the same cases;
- the short convolution (causal-conv1d's, fla's) over a sequence in pieces, its window carried from
  piece to piece (a prompt part, a decode token, a part), with and without a bias, and its gradients;
- a tiny Qwen3-Next, Kimi Linear and Nemotron-H (head sizes the kernels take) on CUDA: logits with the
  libraries' kernels against the same model with TESSERA_RECURRENT_KERNELS=torch.
Tolerances: fp32 within 3e-3 (the chunk kernels' products run in TF32), bf16 within 3e-2.
Written without a GPU at hand: not yet run (docs/features.md).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.gpu.test_cuda_training import in_spawned_process

pytestmark = pytest.mark.gpu
TOLERANCE = {"float32": 3e-3, "bfloat16": 3e-2}
DTYPES = list(TOLERANCE)


def needs(module: str, package: str) -> None:
    """Skip unless `module` is installed (looked up without importing it: no CUDA in this process)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install {package})")


def _rel(got, want) -> float:
    """Runs in the child: max |got - want| over max |want|."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))


def _kernels(kind: str):
    from tessera.models.linear_attention.cuda_kernels import choose

    kernels = choose(kind, "cuda")
    if kernels.chunked is None:
        raise AssertionError(f"no library kernel was chosen: {kernels.describe()}")
    return kernels


def _grad_errors(form, want_form, inputs: list, leaves: list[int], prefix: str) -> dict[str, float]:
    """Runs in the child: the gradients of a form against the reference form's, for the inputs at `leaves`."""
    import torch

    grads = []
    for run in (form, want_form):
        xs = [t.clone().requires_grad_(i in leaves) if t is not None else None for i, t in enumerate(inputs)]
        out, state = run(*xs)
        weights = torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape)
        ((out.float() * weights).sum() + state.float().square().sum()).backward()
        grads.append([xs[i].grad for i in leaves])
    return {f"{prefix} grad {i}": _rel(got, want) for i, got, want in zip(leaves, *grads)}


def delta_rule_errors(kind: str, dtype_name: str) -> dict[str, float]:
    """Runs in the child: flash-linear-attention's chunked and recurrent forms (`kind` "gated_delta_rule":
    a decay per head, q and k of half the heads as Qwen3-Next's groups; "kda": per key channel) against
    delta_rule.py's (q and k repeated per value head), by case."""
    import torch

    from tessera.models.linear_attention.delta_rule import chunked_delta_rule, recurrent_delta_rule

    kernels, dtype = _kernels(kind), getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, S, H, K, V = 2, 150, 4, 64, 64
    HK = H // 2 if kind == "gated_delta_rule" else H

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    def per_value_head(form):
        return lambda q, k, *rest: form(q.repeat_interleave(H // HK, 2), k.repeat_interleave(H // HK, 2), *rest)

    chunked_delta_rule, recurrent_delta_rule = per_value_head(chunked_delta_rule), per_value_head(recurrent_delta_rule)
    q, k, v = randn(B, S, HK, K).to(dtype), randn(B, S, HK, K).to(dtype), randn(B, S, H, V).to(dtype)
    g = -torch.rand(B, S, H, *((K,) if kind == "kda" else ()), device="cuda", generator=gen) * 0.5
    beta = torch.rand(B, S, H, device="cuda", generator=gen).to(dtype)
    errors = {}
    for start_name, start in (("zero", None), ("state", randn(B, H, K, V) * 0.3)):
        cases = [("chunked", kernels.chunked, chunked_delta_rule, S)]
        cases += [(f"recurrent {n}", kernels.recurrent, recurrent_delta_rule, n) for n in (1, 9)]
        for name, form, want_form, n in cases:
            args = (q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], start)
            (got, got_state), (want, want_state) = form(*args), want_form(*args)
            errors[f"{name} from {start_name}"] = _rel(got, want)
            errors[f"{name} from {start_name}: state"] = _rel(got_state, want_state)
        if dtype == torch.float32:
            errors.update(_grad_errors(kernels.chunked, chunked_delta_rule, [q, k, v, g, beta, start],
                                       [0, 1, 2, 3, 4] + ([5] if start is not None else []), f"from {start_name}"))
    return errors


def ssd_errors(dtype_name: str) -> dict[str, float]:
    """Runs in the child: mamba-ssm's chunked scan and state update against ssd.py's forms, by case."""
    import torch
    import torch.nn.functional as F

    from tessera.models.linear_attention.ssd import chunked_ssd, recurrent_ssd

    kernels, dtype = _kernels("ssd"), getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(1)
    Bn, S, H, P, G, N = 2, 150, 8, 64, 2, 64

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    x, Bm, Cm = randn(Bn, S, H, P).to(dtype), randn(Bn, S, G, N).to(dtype), randn(Bn, S, G, N).to(dtype)
    dt, A, D = F.softplus(randn(Bn, S, H) - 1.0), -torch.rand(H, device="cuda", generator=gen).exp(), randn(H)
    errors = {}
    for start_name, start in (("zero", None), ("state", randn(Bn, H, P, N) * 0.3)):
        cases = [("chunked", kernels.chunked, chunked_ssd, S)]
        cases += [(f"recurrent {n}", kernels.recurrent, recurrent_ssd, n) for n in (1, 9)]
        for name, form, want_form, n in cases:
            args = (x[:, :n], dt[:, :n], A, Bm[:, :n], Cm[:, :n], D, start)
            (got, got_state), (want, want_state) = form(*args), want_form(*args)
            errors[f"{name} from {start_name}"] = _rel(got, want)
            errors[f"{name} from {start_name}: state"] = _rel(got_state, want_state)
        if dtype == torch.float32:
            errors.update(_grad_errors(lambda *a: kernels.chunked(*a, chunk=64), lambda *a: chunked_ssd(*a, chunk=64),
                                       [x, dt, A, Bm, Cm, D, start], [0, 1, 3, 4], f"from {start_name}"))
    return errors


def conv_errors(library: str, dtype_name: str) -> dict[str, float]:
    """Runs in the child: a library's short convolution (`library` "causal-conv1d" or "fla") over a
    sequence in pieces, its window carried, against delta_rule.py's `causal_conv`, by case."""
    import torch

    from tessera.models.linear_attention import cuda_kernels as ck
    from tessera.models.linear_attention.delta_rule import causal_conv

    if library == "causal-conv1d":
        form = ck._causal_conv1d_form(*ck.loaded(ck.CAUSAL_CONV1D))
    else:
        form = ck._fla_conv_form(*ck.loaded(ck.FLA_CONV))
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(2)
    B, S, C, W = 2, 60, 192, 4
    x = torch.randn(B, S, C, device="cuda", generator=gen).to(dtype).transpose(1, 2)  # [B, C, S] as the layers give
    weight = torch.randn(C, W, device="cuda", generator=gen) * 0.3
    errors = {}
    for bias_name, bias in (("no bias", None), ("bias", torch.randn(C, device="cuda", generator=gen) * 0.1)):
        got_state = want_state = None
        for lo, hi in ((0, 37), (37, 38), (38, S)):  # a prompt part, a decode token, a part
            got, got_state = form(x[..., lo:hi], weight, got_state, bias)
            want, want_state = causal_conv(x[..., lo:hi], weight, want_state, bias)
            errors[f"{bias_name} {lo}:{hi}"] = _rel(got, want)
            errors[f"{bias_name} {lo}:{hi}: window"] = _rel(got_state, want_state)
        if dtype == torch.float32:
            start = torch.randn(B, C, W - 1, device="cuda", generator=gen)
            errors.update(_grad_errors(form, causal_conv, [x, weight, start, bias],
                                       [0, 1, 2] + ([3] if bias is not None else []), bias_name))
    return errors


def model_logits_error(path: str, dtype_name: str) -> tuple[float, list[str]]:
    """Runs in the child: a model's logits with the libraries' kernels against the same model's with
    TESSERA_RECURRENT_KERNELS=torch, and what ran its recurrent mixers."""
    import os

    import torch

    from tessera.hf import load_pretrained
    from tessera.models.linear_attention.cuda_kernels import ENV, RecurrentKernels, choose_again, kernel_choice

    model = load_pretrained(path, dtype=getattr(torch, dtype_name), device="cuda")
    ids = torch.randint(0, model.cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        got = model(ids).logits
        choices = sorted({kernel_choice(m) for m in model.modules()
                          if isinstance(getattr(m, "kernels", None), RecurrentKernels)})
        os.environ[ENV] = "torch"
        choose_again(model)
        want = model(ids).logits
    return _rel(got, want), choices


def kernel_sized(family: str):
    """A tiny transformers config of `family` whose recurrent heads the kernels take (head sizes of 16 to
    64, channels a multiple of 8)."""
    from tests.models.hf_families import hf_configs

    cfg = hf_configs()[family]
    sizes = {"qwen3_next": dict(linear_key_head_dim=32, linear_value_head_dim=32),
             "kimi_linear": dict(linear_num_heads=2, linear_head_dim=32),
             "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
                                chunk_size=16)}[family]
    for key, value in sizes.items():
        setattr(cfg, key, value)
    return cfg


def _assert_within(errors: dict[str, float], dtype_name: str) -> None:
    worst = {case: e for case, e in errors.items() if not e <= TOLERANCE[dtype_name]}
    assert not worst, f"over {TOLERANCE[dtype_name]}: {worst} (all: {errors})"


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("kind", ["gated_delta_rule", "kda"])
def test_fla_delta_rule_kernels_equal_the_reference(kind, dtype_name):
    needs("fla", "fla-core==0.6.0")
    _assert_within(in_spawned_process(delta_rule_errors, kind, dtype_name), dtype_name)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_mamba_ssd_kernels_equal_the_reference(dtype_name):
    needs("mamba_ssm", "mamba-ssm==2.3.2.post1")
    _assert_within(in_spawned_process(ssd_errors, dtype_name), dtype_name)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("library", ["causal-conv1d", "fla"])
def test_conv_kernels_carry_their_window_as_the_reference(library, dtype_name):
    needs(*{"causal-conv1d": ("causal_conv1d", "causal-conv1d==1.7.0"), "fla": ("fla", "fla-core==0.6.0")}[library])
    _assert_within(in_spawned_process(conv_errors, library, dtype_name), dtype_name)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "nemotron_h"])
def test_tiny_hybrid_model_logits_with_the_kernels_equal_without(tmp_path, family, dtype_name):
    from tests.models.hf_families import random_hf_model

    needs(*(("mamba_ssm", "mamba-ssm==2.3.2.post1") if family == "nemotron_h" else ("fla", "fla-core==0.6.0")))
    random_hf_model(kernel_sized(family), seed=3, std=0.2).save_pretrained(tmp_path)
    error, choices = in_spawned_process(model_logits_error, str(tmp_path), dtype_name)
    library = "mamba-ssm" if family == "nemotron_h" else "flash-linear-attention"
    assert choices and all(f"core {library}" in c for c in choices), choices
    assert error <= TOLERANCE[dtype_name], (error, choices)
