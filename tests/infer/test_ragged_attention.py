"""The CPU paths of the serving step: ragged attention (each row over exactly its own context)
equals attention over the same keys read slot by slot with an explicit mask, for one-token and
longer queries, sliding windows, Llama 4's chunks, GQA and the int8 cache (and, attending in float64,
equals the float64 reference rounded to fp32 to the bit), both through the C++ kernel that reads the
cache in place (its AVX2 loops and its portable ones: head dims of 64, 8 and 12, keys and values of
different widths, bf16) and through PyTorch ops (`TESSERA_CPU_ATTENTION=torch`); an engine decodes
the same tokens either way; the gather buffers are reused across layers; and projections packed
for oneDNN equal `F.linear` and are used only for a model the engine owns."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from tessera.config.model import ModelConfig
from tessera.infer import LLM, LLMEngine, SamplingParams
from tessera.infer.config import EngineConfig
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.linear import FusedLinear, PanelLinear, can_pack, fuse_projections, pack_linears
from tessera.infer.runner.ragged_attention import RaggedContexts
from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.models.attention import ChunkedWindow
from tests.infer.tiny_models import write_model

BS = 4


def _cache(int8: bool, dk: int = 8, dv: int | None = None, groups: int = 2,
           dtype: torch.dtype = torch.float32) -> PagedKVCache:
    """Two layers of random keys [slots, groups, dk] and values [slots, groups, dv] (dv differs from dk
    as MLA's decompressed keys and values do)."""
    dv = dk if dv is None else dv
    cfg = ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=groups, vocab_size=64, ffn_dim=64, max_seq_len=64,
                      head_dim=dk)
    kv = PagedKVCache(cfg, num_blocks=40, block_size=BS, dtype=dtype, int8=int8)
    if dv != dk:
        kv.v = [torch.zeros(40 * BS, groups, dv, dtype=dtype) for _ in range(cfg.n_layers)]
    gen = torch.Generator().manual_seed(0)
    for layer in range(cfg.n_layers):
        slots = torch.arange(40 * BS)
        kv.write(layer, slots, torch.randn(40 * BS, groups, dk, generator=gen),
                 torch.randn(40 * BS, groups, dv, generator=gen))
    return kv


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Which CPU attention serves: the C++ kernel (which must build here: the project installs
    ninja and the machines have a C++ compiler), or PyTorch ops."""
    if request.param == "kernel":
        monkeypatch.delenv(cpu_attention.ENV, raising=False)
        assert cpu_attention.kernel() is not None, "the CPU attention kernel did not build (see the log)"
    else:
        monkeypatch.setenv(cpu_attention.ENV, "torch")
    return request.param


def _reference(kv: PagedKVCache, layer: int, q_SHD: torch.Tensor, L: int, table: list[int], scale: float,
               window: int | None) -> torch.Tensor:
    """The row's keys read slot by slot (dequantized), an explicit boolean mask, GQA by repeating heads."""
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(L)])
    k, v = kv.k[layer][slots].to(q_SHD.dtype), kv.v[layer][slots].to(q_SHD.dtype)  # fp32, or float64
    if kv.int8:
        k, v = k * kv.k_scale[layer][slots][..., None], v * kv.v_scale[layer][slots][..., None]
    S, H = q_SHD.shape[:2]
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [L, H, D]
    q_pos = torch.arange(L - S, L)[:, None]
    k_pos = torch.arange(L)[None, :]
    allowed = k_pos <= q_pos
    if isinstance(window, ChunkedWindow):  # Llama 4: the query's own chunk only
        allowed &= q_pos // window.size == k_pos // window.size
    elif window is not None:
        allowed &= q_pos - k_pos < window
    scores = torch.einsum("shd,lhd->hsl", q_SHD, k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hsl,lhd->shd", scores.softmax(-1), v)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window", [None, 5, 70, ChunkedWindow(8)])
def test_each_row_attends_over_exactly_its_own_context(int8, window, path):
    _attends_each_row_over_its_own_context(_cache(int8), window)


@pytest.mark.parametrize("dk, dv, groups, dtype", [
    (64, 64, 2, torch.float32),  # the AVX2 loops for keys and values; three query heads scored together
    (32, 32, 3, torch.float32),  # two query heads together, values 32 dimensions at a time
    (64, 96, 1, torch.float32),  # all six query heads on one stored head, values 32 at a time
    (8, 8, 6, torch.float32),  # AVX2 scores, portable values; one stored head per query head
    (12, 12, 1, torch.float32),  # portable loops; one stored head for all
    (24, 16, 3, torch.float32),  # keys and values of different widths, as MLA's
    (16, 16, 2, torch.bfloat16),  # a bf16 cache (accumulated in fp32)
])
@pytest.mark.parametrize("window", [None, 5, 70])
def test_the_kernel_equals_the_slot_by_slot_reference_at_every_geometry(dk, dv, groups, dtype, window, path):
    _attends_each_row_over_its_own_context(_cache(False, dk, dv, groups, dtype), window)


@pytest.mark.parametrize("window", [None, 5, 70, ChunkedWindow(8)])
def test_in_float64_each_row_is_the_float64_reference_rounded_to_fp32(window):
    """`PagedKVCache.attention_dtype` float64 (EngineConfig.fp64_attention): every row, the one-query
    rows batched over padded contexts, equals attention over its keys in float64 rounded to fp32, to
    the bit: the order of sums no longer shows."""
    kv = _cache(False, 64, 64, 2)
    kv.attention_dtype = torch.float64
    _attends_each_row_over_its_own_context(kv, window, exact=True)


def _attends_each_row_over_its_own_context(kv: PagedKVCache, window: int | None, exact: bool = False) -> None:
    dk, dv, dtype = kv.k[0].shape[-1], kv.v[0].shape[-1], kv.dtype
    gen = torch.Generator().manual_seed(1)
    # (queries, context length, block table): one-token rows, a 3-token run to verify, a row of one
    # key, tables out of order and longer than the context (blocks past it are never read)
    rows = [(1, 9, [7, 3, 11, 30]), (3, 14, [0, 1, 2, 3]), (1, 1, [25]), (1, 16, [39, 5, 6, 8]), (2, 6, [12, 13])]
    rows += [(16, 40, list(range(14, 24))), (1, 37, list(range(39, 29, -1)))]  # a 16-token chunk, a long row
    # prompt chunks past 16 queries (the kernel's tiled loops: 32 queries by 64 keys): one from position 0,
    # one after 30 positions of context (three query tiles, the last partial; keys in three blocks),
    # one of 40 queries after 110 positions (its first tile's keys start mid-block with a window)
    rows += [(17, 17, [9, 4, 31, 2, 20]), (70, 100, list(range(39, -1, -1))[:25]), (40, 150, list(range(38)))]
    T = sum(s for s, _, _ in rows)
    q_THD = torch.randn(T, 6, dk, generator=gen).to(dtype)
    contexts, at = RaggedContexts(BS), 0
    for S, L, table in rows:
        contexts.add(at, S, L, table)
        at += S
    contexts.freeze(torch.device("cpu"))
    scale = 1 / math.sqrt(dk)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layer in range(2):
        out = torch.full((T, 6, dv), float("nan"), dtype=dtype)
        contexts.attend(kv, layer, q_THD, out, scale, window)
        at = 0
        for S, L, table in rows:
            if exact:
                want = _reference(kv, layer, q_THD[at:at + S].double(), L, table, scale, window).float()
                assert torch.equal(out[at:at + S], want), (S, L, (out[at:at + S] - want).abs().max())
            else:
                want = _reference(kv, layer, q_THD[at:at + S].float(), L, table, scale, window)
                torch.testing.assert_close(out[at:at + S].float(), want, rtol=tol, atol=tol)
            at += S
    if exact:  # the one-query rows went as one batch (a chunked window takes the rows one by one)
        assert (window in contexts.one_query) == (not isinstance(window, ChunkedWindow))


def test_the_cpu_gather_reuses_its_buffers_across_layers():
    kv = _cache(False)
    blocks = torch.tensor([3, 9, 1])
    k0, _ = kv.gather_flat(0, blocks, torch.float32)
    first = k0.data_ptr()
    torch.testing.assert_close(k0.view(3, BS, 2, 8), kv.k[0].view(40, BS, 2, 8)[blocks])
    k1, v1 = kv.gather_flat(1, blocks, torch.float32)
    assert k1.data_ptr() == first  # the same buffer: no allocation per layer
    torch.testing.assert_close(v1.view(3, BS, 2, 8), kv.v[1].view(40, BS, 2, 8)[blocks])


def test_packed_projections_equal_f_linear_and_keep_hooks():
    if not can_pack("cpu", torch.float32):
        pytest.skip("this torch has no oneDNN linear")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    x = torch.randn(5, 3, 24)
    want = model(x)
    seen = []
    model[2].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert pack_linears(model) == 2
    assert all(type(m) is PanelLinear for m in (model[0], model[2]))
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert seen == [torch.Size([5, 3, 8])]
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight"}  # the dense weights stay


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_projections_equal_the_separate_ones_and_step_aside_for_hooks(tmp_path, family):
    if not can_pack("cpu", torch.float32):
        pytest.skip("this torch has no oneDNN linear")
    write_model(tmp_path, family)
    model = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, cpu_prepack=False)).executor.model
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.inference_mode():
        want = model(ids).logits
    pack_linears(model)
    assert fuse_projections(model) == 2 * model.cfg.n_layers  # each layer's q/k/v and gate/up
    attention, mlp = model.layers["0"].attention, model.layers["0"].feed_forward
    assert isinstance(attention.fused_qkv, FusedLinear) and isinstance(mlp.fused_gate_up, FusedLinear)
    assert type(attention.wq) is nn.Linear and not hasattr(attention.wq, "packed")  # one packed copy, the fused one
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    # a hook on one member (as a LoRA adapter's): the modules run one by one, so the hook sees its call
    seen = []
    handle = attention.wk.register_forward_hook(lambda m, i, o: seen.append(o.shape) or o * 0)
    with torch.inference_mode():
        hooked = model(ids).logits
    handle.remove()
    assert seen == [torch.Size([1, 6, attention.wk.out_features])]
    assert not torch.allclose(hooked, want, rtol=1e-3, atol=1e-3)  # the hook's zeroed keys reached the logits
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_only_a_model_the_engine_loaded_is_packed(tmp_path):
    write_model(tmp_path, "llama")
    owned = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4))
    packed = [m for m in owned.executor.model.modules() if isinstance(m, PanelLinear)]
    assert (len(packed) > 0) == can_pack("cpu", torch.float32)
    off = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, cpu_prepack=False))
    assert not any(isinstance(m, PanelLinear) for m in off.executor.model.modules())
    shared = off.executor.model  # handed to another engine: a model someone else may hold (a trainer)
    LLMEngine.from_model(shared, EngineConfig(block_size=4))
    assert not any(isinstance(m, PanelLinear) for m in shared.modules())
    ids = torch.tensor([[5, 9, 2]])
    torch.testing.assert_close(owned.executor.model(ids).logits, off.executor.model(ids).logits,
                               rtol=1e-5, atol=1e-5)


def test_an_engine_decodes_the_same_tokens_with_the_kernel_and_with_torch_ops(tmp_path, monkeypatch):
    write_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), EngineConfig(block_size=4, max_num_seqs=8, enable_prefix_caching=False))
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6][:n] for n in (1, 3, 9, 6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None
    with_kernel = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setenv(cpu_attention.ENV, "torch")
    with_torch = [o.token_ids for o in llm.generate(prompts, params)]
    assert with_kernel == with_torch and all(len(t) == 12 for t in with_kernel)


@pytest.mark.slow
def test_the_kernel_builds_with_the_ninja_package_alone(tmp_path):
    """A machine without a system ninja (only the PyPI package's, in the environment's bin folder, which
    is not on PATH when the environment is not activated): the kernel still builds, from nothing."""
    import shutil
    import subprocess
    import sys

    from tests.hang_guard import HANG_S
    from tests.train.runs import ROOT

    bin_dir = tmp_path / "bin"  # every program of the system's folders but ninja
    bin_dir.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        for program in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if program != "ninja" and not (bin_dir / program).exists():
                (bin_dir / program).symlink_to(os.path.join(folder, program))
    env = {**os.environ, "PATH": str(bin_dir), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": str(ROOT)}
    probe = "import shutil; from tessera.infer.cpu.attention import kernel; print(shutil.which('ninja'), kernel())"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["None", "tessera_cpu.paged_attention"], run.stdout + run.stderr[-2000:]
    assert shutil.which("g++", path=str(bin_dir))  # the build had its compiler, and no ninja but the package's
