"""An int8 KV cache read by the CPU attention kernel as it lies (no block dequantized into memory):
its output is attention over the fp32 keys and values within the bound their rounding allows (derived
per query below), and nonzero; its AVX2 loops and its portable ones give the same bits, and so do one
and two threads; an engine with `kv_cache_dtype="int8"` attends through the kernel and decodes a tiny
model's greedy tokens equal to its fp32 cache's; the engine's accounting holds (D + 4) / 4 D of the
fp32 cache's bytes per block, so the same `kv_cache_gib` holds that many times the blocks."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.config.model import ModelConfig
from tessera.infer import LLM, SamplingParams
from tessera.infer.config import EngineConfig
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.runner.ragged_attention import RaggedContexts
from tessera.infer.scheduling.kv_cache import PagedKVCache, bytes_per_block
from tests.infer.tiny_models import write_model

BS = 4
# (queries, context length, block table): decodes, a run to verify, a one-key row, a 16-query chunk, and
# prompt chunks past 16 queries (the tiled loops) from position 0 and after earlier context
ROWS = [(1, 9, [7, 3, 11, 30]), (3, 14, [0, 1, 2, 3]), (1, 1, [25]), (1, 37, list(range(39, 29, -1))),
        (16, 40, list(range(14, 24))), (17, 17, [9, 4, 31, 2, 20]), (40, 100, list(range(39, 14, -1)))]


def _caches(dk: int, dv: int, groups: int) -> tuple[PagedKVCache, PagedKVCache]:
    """An fp32 cache and an int8 one holding the same random keys and values (two layers)."""
    cfg = ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=groups, vocab_size=64, ffn_dim=64, max_seq_len=64,
                      head_dim=dk)
    full, int8 = (PagedKVCache(cfg, num_blocks=40, block_size=BS, dtype=torch.float32, int8=q) for q in (False, True))
    if dv != dk:
        full.v = [torch.zeros(40 * BS, groups, dv) for _ in range(2)]
        int8.v = [torch.zeros(40 * BS, groups, dv, dtype=torch.int8) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(40 * BS)
    for layer in range(2):
        # heads of very different sizes, so that the per-(token, head) scales matter
        k = torch.randn(40 * BS, groups, dk, generator=gen) * torch.logspace(-1, 1, groups)[:, None]
        v = torch.randn(40 * BS, groups, dv, generator=gen) * torch.logspace(1, -1, groups)[:, None]
        full.write(layer, slots, k, v)
        int8.write(layer, slots, k, v)
    return full, int8


def _contexts() -> tuple[RaggedContexts, int]:
    contexts, at = RaggedContexts(BS), 0
    for S, L, table in ROWS:
        contexts.add(at, S, L, table)
        at += S
    contexts.freeze(torch.device("cpu"))
    return contexts, at


def _kernel(kv: PagedKVCache, layer: int, contexts: RaggedContexts, q: torch.Tensor, dv: int, window: int,
            portable: bool = False) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1], dv), float("nan"), dtype=q.dtype)
    scales = (kv.k_scale[layer], kv.v_scale[layer]) if kv.int8 else (None, None)
    cpu_attention.kernel()(q, out, kv.k[layer], kv.v[layer], contexts.rows_R4, contexts.block_index, BS,
                           1 / math.sqrt(q.shape[-1]), window, *scales, portable)
    return out


def _bound(full: PagedKVCache, int8: PagedKVCache, layer: int, q_SHD: torch.Tensor, L: int, table: list[int],
           scale: float, window: int) -> torch.Tensor:
    """Per query and head, how far int8 rounding may move the output. A key's values move by at most
    s_k / 2 each, so a score by e = scale * sum_d |q_d| * max_j s_kj / 2; the softmax weights then
    move by at most p_j (e^(2e) - 1), and the weighted values by max_j |v_j| (e^(2e) - 1) + max_j s_vj / 2."""
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(L)])
    rep = q_SHD.shape[1] // full.k[layer].shape[1]
    sk = int8.k_scale[layer][slots].repeat_interleave(rep, 1)  # [L, H]
    sv = int8.v_scale[layer][slots].repeat_interleave(rep, 1)
    vmax = full.v[layer][slots].abs().amax(-1).repeat_interleave(rep, 1)  # [L, H]
    lo = max(0, L - q_SHD.shape[0] - window + 1) if window else 0  # keys any of the row's queries may see
    e = scale * q_SHD.abs().sum(-1) * sk[lo:].amax(0) / 2  # [S, H]
    return vmax[lo:].amax(0) * torch.expm1(2 * e) + sv[lo:].amax(0) / 2 + 1e-5


@pytest.mark.parametrize("dk, dv, groups", [(64, 64, 2), (8, 8, 6), (12, 12, 1), (24, 16, 3)])
@pytest.mark.parametrize("window", [0, 5])
def test_int8_attention_is_within_the_rounding_bound_of_the_fp32_cache(dk, dv, groups, window):
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"
    full, int8 = _caches(dk, dv, groups)
    contexts, T = _contexts()
    q = torch.randn(T, 6, dk, generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        want, got = _kernel(full, layer, contexts, q, dv, window), _kernel(int8, layer, contexts, q, dv, window)
        assert 0 < (got - want).abs().max()  # the rounding is there: the int8 values were read
        at = 0
        for S, L, table in ROWS:
            bound = _bound(full, int8, layer, q[at:at + S], L, table, 1 / math.sqrt(dk), window)
            assert ((got[at:at + S] - want[at:at + S]).abs().amax(-1) <= bound).all(), (S, L)
            at += S


@pytest.mark.parametrize("dk, dv, groups, dtype", [(64, 64, 2, torch.float32), (8, 8, 6, torch.float32),
                                                   (12, 12, 1, torch.float32), (24, 16, 3, torch.float32),
                                                   (64, 64, 2, torch.bfloat16)])
def test_int8_attention_is_the_same_bits_on_avx2_and_portable_loops_and_any_thread_count(dk, dv, groups, dtype):
    _, int8 = _caches(dk, dv, groups)
    contexts, T = _contexts()
    q = torch.randn(T, 6, dk, generator=torch.Generator().manual_seed(2)).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernel(int8, 1, contexts, q, dv, 5)
        portable = _kernel(int8, 1, contexts, q, dv, 5, portable=True)
        torch.set_num_threads(2)
        two = _kernel(int8, 1, contexts, q, dv, 5)
    finally:
        torch.set_num_threads(threads)
    assert not one.isnan().any()
    assert torch.equal(one, portable) and torch.equal(one, two)


def test_an_int8_cache_decodes_the_fp32_caches_greedy_tokens_through_the_kernel(tmp_path, monkeypatch):
    """16 greedy tokens of 4 prompts (decodes batched, prompts in chunks of 8 past earlier context), each
    equal to the fp32 cache's; every attention call of the int8 engine went to the kernel."""
    write_model(tmp_path, "llama", std=0.25)
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21][:n] for n in (1, 3, 20, 9)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    op = cpu_attention.kernel()
    calls = []
    monkeypatch.setattr(cpu_attention, "kernel", lambda: (lambda *a: calls.append(a[2].dtype) or op(*a)))
    tokens = {}
    for dtype in (None, "int8"):
        config = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=16, kv_cache_dtype=dtype,
                              enable_prefix_caching=False)
        calls.clear()
        tokens[dtype] = [o.token_ids for o in LLM(str(tmp_path), config).generate(prompts, params)]
        assert calls and set(calls) == {torch.int8 if dtype else torch.float32}
    assert tokens["int8"] == tokens[None] and all(len(t) == 16 for t in tokens[None])


def test_the_int8_cache_holds_its_blocks_in_a_quarter_of_the_bytes(tmp_path):
    """Bytes per block as counted and as allocated: (D + 4) / 4 D of fp32's (D = 8 here: 0.375; 0.27 at
    D = 64), (D + 4) / 2 D of bf16's; the same budget holds the inverse times the blocks."""
    write_model(tmp_path, "llama")
    engines = {}
    for dtype in (None, "int8"):
        config = EngineConfig(block_size=4, kv_cache_gib=0.001, max_num_seqs=4096, kv_cache_dtype=dtype)
        engines[dtype] = LLM(str(tmp_path), config).engine
    cfg, D = engines[None].cfg, engines[None].cfg.head_dim
    full, int8 = (bytes_per_block(cfg, 4, dtype, q) for dtype, q in ((torch.float32, False), (torch.float32, True)))
    assert int8 * 4 * D == full * (D + 4)
    bf16 = bytes_per_block(cfg, 4, torch.bfloat16, False)
    assert bytes_per_block(cfg, 4, torch.bfloat16, True) * 2 * D == bf16 * (D + 4)
    for dtype, per_block in ((None, full), ("int8", int8)):
        kv = engines[dtype].kv
        assert kv.nbytes == kv.num_blocks * per_block  # the tensors allocated are the bytes counted
        assert kv.num_blocks - 1 == int(0.001 * 2**30) // per_block  # the budget's blocks (+1 scratch block)
