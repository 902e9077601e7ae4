"""DeepSeek-V3.2's sparse attention (tessera/models/attention_variants/sparse_mla.py): with index_topk at least the
sequence length it is dense MLA; with fewer, the keys each query attends to are those a direct
computation of the indexer's formula picks, and the output is softmax attention over exactly them;
model.mla.index_topk is refused without a query latent."""

from __future__ import annotations

import copy

import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.models.attention_variants.sparse_mla import SparseLatentAttention
from tessera.models.mla import MultiHeadLatentAttention
from tessera.models.transformer import Transformer

S = 12
MOE = dict(num_experts=4, top_k=2, ffn_dim=16, score_func="sigmoid", expert_bias=True)


def _cfg(topk: int | None) -> ModelConfig:
    cfg = ModelConfig(family="deepseek_v3", vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=48, max_seq_len=64,
                      mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                               index_topk=topk, index_n_heads=3, index_head_dim=8), moe=MOE)
    cfg.validate()
    return cfg


def _inputs(cfg: ModelConfig, B: int = 2):
    torch.manual_seed(0)
    model = Transformer(cfg)
    tables = model.rope_tables(torch.arange(S).expand(B, S), torch.float32)
    x = torch.randn(B, S, cfg.dim)
    return x, tables.cos, tables.sin


def _sparse(cfg: ModelConfig) -> SparseLatentAttention:
    torch.manual_seed(1)
    attn = SparseLatentAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return attn


def test_topk_at_least_the_sequence_is_dense_mla():
    cfg = _cfg(topk=S)
    sparse = _sparse(cfg)
    dense = MultiHeadLatentAttention(copy.deepcopy(cfg), 0)
    missing = dense.load_state_dict(sparse.state_dict(), strict=False)
    assert not missing.missing_keys and all(k.startswith("indexer.") for k in missing.unexpected_keys)
    x, cos, sin = _inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x, cos, sin), dense(x, cos, sin), atol=1e-5, rtol=1e-5)


def _reference_scores(attn: SparseLatentAttention, x, cos, sin) -> list[list[dict[int, float]]]:
    """Per batch row and query, the indexer's score of each key it may see, written from the formula term by term."""
    ix = attn.indexer
    q_latent = attn.q_norm(attn.wq_a(x))
    B = x.shape[0]
    R = cos.shape[-1]

    def rotate(v, b, t):  # half-layout RoPE on the first R dims of one vector at position t
        c, s = cos[b, t], sin[b, t]
        head, tail = v[:R], v[R:]
        half = torch.cat((-head[R // 2:], head[:R // 2]))
        return torch.cat((head * c + half * s, tail))

    out = []
    for b in range(B):
        keys = [rotate(torch.nn.functional.layer_norm(ix.wk.weight @ x[b, s], (ix.head_dim,), ix.k_norm.weight,
                                                      ix.k_norm.bias, 1e-6), b, s) for s in range(S)]
        rows = []
        for t in range(S):
            w = (ix.weights_proj.weight @ x[b, t]) / ix.n_heads ** 0.5
            qs = (ix.wq_b.weight @ q_latent[b, t]).view(ix.n_heads, ix.head_dim)
            score = {s: sum(float(w[j]) * max(0.0, float(rotate(qs[j], b, t) @ keys[s]) / ix.head_dim ** 0.5)
                            for j in range(ix.n_heads)) for s in range(t + 1)}
            rows.append(score)
        out.append(rows)
    return out


def test_selected_keys_and_output_equal_a_direct_computation():
    topk = 4
    cfg = _cfg(topk=topk)
    attn = _sparse(cfg)
    x, cos, sin = _inputs(cfg)
    seen: list[torch.Tensor] = []
    real_select = __import__("tessera.models.attention_variants.sparse_mla", fromlist=["select_keys"]).select_keys

    def spy(scores, allowed, k):
        chosen = real_select(scores, allowed, k)
        seen.append(chosen)
        return chosen

    mp = pytest.MonkeyPatch()
    mp.setattr("tessera.models.attention_variants.sparse_mla.select_keys", spy)
    try:
        with torch.no_grad():
            got = attn(x, cos, sin)
    finally:
        mp.undo()
    with torch.no_grad():
        scores = _reference_scores(attn, x, cos, sin)
        chosen = seen[0]
        want_sets = [[set(chosen[b, t].nonzero().flatten().tolist()) for t in range(S)] for b in range(2)]
        for b in range(2):
            for t in range(S):  # a top-k of the direct scores (keys tied at the cut may go either way)
                picked, score = want_sets[b][t], scores[b][t]
                assert len(picked) == min(topk, t + 1) and picked <= set(score)
                left = [score[s] for s in score if s not in picked]
                assert not left or min(score[s] for s in picked) >= max(left) - 1e-5
        assert sum(len(r) < t + 1 for rows in want_sets for t, r in enumerate(rows)) == 2 * (S - topk)  # keys cut
        q, k, v, _ = attn.project(x, cos, sin)
        want = torch.zeros(2, S, attn.n_heads, attn.v_dim)
        for b in range(2):
            for t in range(S):
                keep = sorted(want_sets[b][t])
                logits = torch.einsum("hd,hkd->hk", q[b, :, t], k[b, :, keep]) * attn.scale
                want[b, t] = torch.einsum("hk,hkv->hv", logits.softmax(-1), v[b, :, keep])
        torch.testing.assert_close(got, attn.wo(want.reshape(2, S, -1)), atol=1e-5, rtol=1e-5)


def test_index_topk_needs_a_query_latent():
    with pytest.raises(ConfigError, match=r"model.mla.index_topk=4 is invalid: .*q_lora_rank"):
        ModelConfig(family="deepseek_v3", vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=48, moe=MOE,
                    mla=dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                             v_head_dim=8, index_topk=4)).validate()
    with pytest.raises(ConfigError, match=r"model.mla.index_head_dim=2 is invalid: must be in 4\.\."):
        ModelConfig(family="deepseek_v3", vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=48, moe=MOE,
                    mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                             v_head_dim=8, index_topk=4, index_head_dim=2)).validate()


def test_parameter_count_and_indexer_flops_are_the_modules():
    from torch.utils.flop_counter import FlopCounterMode

    from tessera.models.counting import count_params
    from tessera.models.flops import (
        attention_core_flops_per_token,
        flops_per_token,
        forward_flops_per_token,
        indexer_forward_flops_per_token,
    )

    cfg = _cfg(topk=4)
    model = Transformer(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    attn = _sparse(cfg)
    x, cos, sin = _inputs(cfg, B=1)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        q_latent = attn.q_norm(attn.wq_a(x))
        before = counter.get_total_flops()
        iq, w = attn.indexer.queries(x, q_latent, cos, sin)
        attn.indexer.scores(iq, w, attn.indexer.keys(x, cos, sin))
    # every query scores all S keys here: the count without causality
    assert counter.get_total_flops() - before == S * indexer_forward_flops_per_token(cfg, S, causal=False)
    # the core sees at most index_topk keys: 4 - 16 / (2 S) per query, causal
    core = attention_core_flops_per_token(cfg, S)
    assert core == 2.0 * cfg.n_heads * (12 + 8) * (4 - 16 / (2 * S))
    assert flops_per_token(cfg, S) == 3 * forward_flops_per_token(cfg, S) - 2 * indexer_forward_flops_per_token(cfg, S)
