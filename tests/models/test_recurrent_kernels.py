"""Which kernels run the recurrent mixers (tessera/models/linear_attention/cuda_kernels.py), on a machine
without CUDA: CPU inputs get the PyTorch forms (the layer's output is the reference functions'),
chosen once at the first call and readable; `TESSERA_RECURRENT_KERNELS=torch` forces them for CUDA
too without importing a library; a library that does not import is named once in the log with its
pip package, and the PyTorch forms stand in; the CPU library's chunk terms show in the choice where
the serving engine installed them. The libraries' kernels against the reference:
tests/gpu/test_cuda_recurrent_kernels.py."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from tessera.config.errors import ModelError
from tessera.config.model import ModelConfig
from tessera.models.linear_attention import cuda_kernels
from tessera.models.linear_attention.cuda_kernels import choose, choose_again, kernel_choice, kernels_for
from tessera.models.linear_attention.delta_rule import causal_conv, chunked_delta_rule
from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet
from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
from tessera.models.linear_attention.mamba2 import Mamba2Mixer
from tessera.models.transformer import init_by_name

LIBRARY_MODULES = ("fla", "causal_conv1d", "mamba_ssm")


@pytest.fixture(autouse=True)
def fresh_imports():
    """Each test imports the libraries anew (`loaded` remembers an answer per process)."""
    loaded = cuda_kernels.loaded
    loaded.cache_clear()
    cuda_kernels.MISSING.clear()
    yield
    loaded.cache_clear()
    cuda_kernels.MISSING.clear()


def _mixers() -> dict[str, torch.nn.Module]:
    la = dict(layers=[0], n_key_heads=2, n_value_heads=4, key_head_dim=8, value_head_dim=6, conv_width=4, chunk_size=8)
    gdn = ModelConfig(family="llama", vocab_size=32, dim=24, n_layers=1, n_heads=4, ffn_dim=32, linear_attention=la)
    kda = ModelConfig(family="llama", vocab_size=32, dim=24, n_layers=1, n_heads=4, ffn_dim=32,
                      linear_attention={**la, "n_key_heads": 3, "n_value_heads": 3, "value_head_dim": 8, "kind": "kda"})
    mamba = ModelConfig(family="nemotron_h", vocab_size=64, dim=24, n_layers=1, n_heads=2, ffn_dim=32, norm_eps=1e-5,
                        activation="relu2", sublayers=["mamba"],
                        mamba=dict(n_heads=6, head_dim=4, state_size=5, n_groups=3, conv_width=4, chunk_size=8))
    mixers = {"gated_delta_rule": GatedDeltaNet(gdn, 0), "kda": KimiDeltaAttention(kda, 0),
              "ssd": Mamba2Mixer(mamba, 0)}
    for mixer in mixers.values():
        init_by_name(mixer.named_parameters(), {"norm.weight", "o_norm.weight"}, 3, 0.2)
    return mixers


def test_cpu_inputs_run_the_pytorch_forms_chosen_once():
    x = torch.randn(2, 11, 24, generator=torch.Generator().manual_seed(0))
    for kind, mixer in _mixers().items():
        assert kernel_choice(mixer) == "not chosen yet (chosen at the first call)"
        with torch.no_grad():
            out, state = mixer.mix(x)
        chosen = mixer.kernels
        assert kernel_choice(mixer) == "cpu: core pytorch; conv pytorch", kind
        assert chosen.conv is causal_conv and chosen.chunked is None and chosen.recurrent is None
        with torch.no_grad():
            mixer.mix(x[:, :1], state)  # a decode token: the choice is kept, not made again
        assert mixer.kernels is chosen
    assert not {name.split(".")[0] for name in sys.modules} & set(LIBRARY_MODULES), "a library imported for CPU"


def test_the_layer_with_its_choice_equals_the_reference_forms():
    """Gated DeltaNet's chunked core through the CPU choice is `chunked_delta_rule` itself (bit for bit),
    q and k given per key head (two, each serving two value heads, as a library's form takes them)
    repeated per value head for it."""
    from tessera.models.linear_attention.gated_deltanet import delta_rule

    mixer = _mixers()["gated_delta_rule"]
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 20, 2, 8, generator=gen), torch.randn(1, 20, 2, 8, generator=gen)
    v, g, beta = torch.randn(1, 20, 4, 6, generator=gen), -torch.rand(1, 20, 4, generator=gen), torch.rand(1, 20, 4)
    got = delta_rule(q, k, v, g, beta, None, None, 8, None, None, kernels_for(mixer, q, "gated_delta_rule"))
    want = chunked_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta, None, chunk=8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_choice_follows_the_device_type_and_is_forgotten_on_asking():
    mixers = _mixers()
    for kind, mixer in mixers.items():
        assert kernels_for(mixer, torch.empty(0, device="meta"), kind).device == "meta"
        assert kernels_for(mixer, torch.empty(0), kind).device == "cpu"  # another device type: chosen anew
    model = torch.nn.ModuleList(mixers.values())
    assert choose_again(model) == 3 and all(m.kernels is None for m in mixers.values())
    assert choose_again(model) == 0


def test_forced_reference_imports_no_library(monkeypatch):
    monkeypatch.setenv(cuda_kernels.ENV, "torch")
    asked = []
    monkeypatch.setattr(cuda_kernels, "loaded", lambda library: asked.append(library) or None)
    for kind in cuda_kernels.KINDS:
        chosen = choose(kind, "cuda")  # (a device name: CUDA is not initialised)
        assert chosen.chunked is None and chosen.recurrent is None and chosen.conv is causal_conv
        assert chosen.describe() == ("cuda: core pytorch (TESSERA_RECURRENT_KERNELS=torch); "
                                     "conv pytorch (TESSERA_RECURRENT_KERNELS=torch)")
    assert asked == []


def test_a_missing_library_is_named_once_with_its_pip_package(monkeypatch, caplog):
    for module in LIBRARY_MODULES:  # as on a CUDA machine without them (None in sys.modules: ImportError)
        monkeypatch.setitem(sys.modules, module, None)
    with caplog.at_level(logging.WARNING, logger="tessera.models"):
        delta = choose("gated_delta_rule", "cuda")
        kda = choose("kda", "cuda")
        ssd = choose("ssd", "cuda")
        choose("gated_delta_rule", "cuda")
    for chosen in (delta, kda, ssd):
        assert chosen.describe() == "cuda: core pytorch; conv pytorch"
        assert chosen.chunked is None and chosen.recurrent is None and chosen.conv is causal_conv
    lines = [r.getMessage() for r in caplog.records]
    for package in ("fla-core==0.6.0", "causal-conv1d==1.7.0", "mamba-ssm==2.3.2.post1"):
        assert any(f"pip install {package}" in line for line in lines), (package, lines)
    assert len(lines) == 3, lines  # once per package (fla-core's delta rule, KDA and convolution in one line)
    assert all("is not importable here (ModuleNotFoundError" in line for line in lines)


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ModelError, match="kind='rwkv' is invalid: one of gated_delta_rule, kda, ssd"):
        choose("rwkv", "cpu")


def test_the_cpu_librarys_chunk_terms_show_in_the_choice():
    """A served fp32 model on CPU: `fuse_layer_ops` fills the delta-rule mixers' `fused_chunk_terms`,
    and the choice says that their chunked form takes them (Mamba-2 has no such seam)."""
    from tessera.infer.cpu import attention as cpu_attention
    from tessera.infer.cpu.layer_ops import fuse_layer_ops

    if not cpu_attention.library_available():
        pytest.skip("the CPU library does not build here")
    mixers = _mixers()
    fuse_layer_ops(torch.nn.ModuleList(mixers.values()))
    x = torch.randn(1, 9, 24)
    with torch.no_grad():
        for mixer in mixers.values():
            mixer.mix(x)
    terms = ("cpu: core pytorch with the CPU library's chunk terms (tessera_cpu.delta_chunk_terms, no gradients); "
             "conv pytorch")
    assert kernel_choice(mixers["gated_delta_rule"]) == kernel_choice(mixers["kda"]) == terms
    assert kernel_choice(mixers["ssd"]) == "cpu: core pytorch; conv pytorch"


def _never(*args, **kwargs):
    raise AssertionError("a kernel without a backward was called where a gradient is wanted")


def test_a_token_that_wants_gradients_leaves_the_backwardless_kernels_to_the_pytorch_forms():
    """flash-linear-attention's fused recurrent kernels and mamba-ssm's state update have no backward:
    a recurrent call whose inputs want gradients runs the PyTorch form (q and k per key head repeated
    for it), and its gradients reach the inputs."""
    from tessera.models.linear_attention.delta_rule import recurrent_delta_rule
    from tessera.models.linear_attention.ssd import recurrent_ssd

    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 3, 2, 8, generator=gen), torch.randn(1, 3, 2, 8, generator=gen)
    v, g, beta = torch.randn(1, 3, 4, 6, generator=gen), -torch.rand(1, 3, 4, generator=gen), torch.rand(1, 3, 4)
    _, recurrent = cuda_kernels._delta_rule_forms(_never, _never)
    leaf = v.clone().requires_grad_()
    got = recurrent(q, k, leaf, g, beta)
    want = recurrent_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta)
    assert all(torch.equal(a.detach(), b) for a, b in zip(got, want))
    got[0].sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0

    x, dt = torch.randn(1, 3, 4, 2, generator=gen).requires_grad_(), torch.rand(1, 3, 4, generator=gen)
    A, Bm, Cm, D = -torch.rand(4, generator=gen), torch.randn(1, 3, 2, 5), torch.randn(1, 3, 2, 5), torch.randn(4)
    _, recurrent = cuda_kernels._ssd_forms(_never, _never)
    got = recurrent(x, dt, A, Bm, Cm, D)
    assert all(torch.equal(a, b) for a, b in zip(got, recurrent_ssd(x, dt, A, Bm, Cm, D)))
