"""The FLOP count behind MFU (tessera.models.flops) against the published formulas and figures."""

from __future__ import annotations

import pytest

from tessera.config import ModelConfig, get_preset
from tessera.config.errors import ConfigError
from tessera.models.counting import count_params
from tessera.models.flops import (
    attention_core_flops_per_token,
    attention_keys_per_query,
    flops_per_token,
    forward_flops_per_token,
    mfu,
    recompute_flops_per_token,
    six_nd,
    step_flops,
)

# GPT-3 175B (Brown et al. 2020): h = 12288, 96 layers, 96 heads, s = 2048, V = 51200 (padded).
# Its MLP is 4h with GELU (16 B s h^2 forward FLOPs); a SwiGLU of ffn = 8h/3 = 32768 has the same
# 3 * 2 * h * ffn = 16 h^2 per token, so this dense config matches the paper's conventions.
H, L, A, SEQ, V = 12288, 96, 96, 2048, 51200
GPT3 = ModelConfig(vocab_size=V, dim=H, n_layers=L, n_heads=A, ffn_dim=8 * H // 3, max_seq_len=SEQ)


def test_narayanan_formula_with_full_recomputation():
    """Narayanan et al. 2021 (arXiv 2104.04473), appendix: a step of B sequences with full
    recomputation costs 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (non-causal attention)."""
    batch = 1536
    want = 96 * batch * SEQ * L * H**2 * (1 + SEQ / (6 * H) + V / (16 * L * H))
    got = step_flops(GPT3, SEQ, batch * SEQ, causal=False, recompute="full")
    assert got == pytest.approx(want, rel=1e-12)


def test_narayanan_formula_without_recomputation():
    """Without recomputation the same appendix gives 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    batch = 8
    want = 72 * batch * SEQ * L * H**2 * (1 + SEQ / (6 * H) + V / (12 * L * H))
    assert step_flops(GPT3, SEQ, batch * SEQ, causal=False) == pytest.approx(want, rel=1e-12)


def test_megatron_generalisation_to_gqa_swiglu_and_moe():
    """Megatron-LM's count for GQA (g groups), SwiGLU (x 3/2) and top-k MoE:
    12 B s l h^2 [(1 + g/a + s/h)(q/h) + (ffn/h) k (3/2) + V/(2 l h)], plus the router (6 E h per
    token per MoE layer), which that formula leaves out; non-causal."""
    cfg = get_preset("mixtral-8x7b")
    h, l, a, g, s = cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, 4096
    q = a * cfg.head_dim
    e = cfg.moe
    per_token = 12 * l * h**2 * ((1 + g / a + s / h) * (q / h) + (e.ffn_dim / h) * e.top_k * 1.5
                                 + cfg.vocab_size / (2 * l * h))
    router = 6 * e.num_experts * h * l
    assert flops_per_token(cfg, s, causal=False) == pytest.approx(per_token + router, rel=1e-12)


def test_causal_attention_counts_half_the_score_matrix():
    cfg = get_preset("llama3-8b")
    s = 8192
    full, causal = flops_per_token(cfg, s, causal=False), flops_per_token(cfg, s)
    attention_full = 3 * cfg.n_layers * 2 * cfg.n_heads * 2 * cfg.head_dim * s  # 12 l h s (PaLM)
    assert full - causal == pytest.approx(attention_full / 2)
    assert attention_keys_per_query(s) == s / 2


def test_sliding_window_counts_the_band():
    assert attention_keys_per_query(4096, window=4096) == 2048
    assert attention_keys_per_query(8192, window=4096) == 4096 - 4096**2 / (2 * 8192)
    assert attention_keys_per_query(8192, causal=False, window=1024) == 1024


def test_a_window_on_some_layers_counts_the_band_there_only():
    """OLMo 3: three layers of four in a 4096 window at 65,536 positions; the full layer attends to
    half the sequence, the windowed ones to the band, and the mean is over the four."""
    from tessera.config import get_preset

    cfg = get_preset("olmo3-7b", n_layers=4, window_layers=[0, 1, 2])
    s, per_key = 65536, 2 * cfg.n_heads * 2 * cfg.head_dim
    band = attention_keys_per_query(s, window=4096)
    assert attention_core_flops_per_token(cfg, s, layer=1) == per_key * band
    assert attention_core_flops_per_token(cfg, s, layer=3) == per_key * s / 2
    assert attention_core_flops_per_token(cfg, s) == pytest.approx(per_key * (3 * band + s / 2) / 4)


def test_six_nd_seed_figures():
    """Kaplan et al. 2020: C = 6 N D. Seed figures: GPT-3 175B x 300B tokens = 3.15e23,
    LLaMA-65B x 1.4T = 5.46e23, LLaMA-2-70B x 2T = 8.4e23, PaLM 540B x 780B = 2.53e24."""
    assert six_nd(175e9, 300e9) == pytest.approx(3.15e23)
    assert six_nd(65e9, 1.4e12) == pytest.approx(5.46e23)
    assert six_nd(70e9, 2e12) == pytest.approx(8.4e23)
    assert round(six_nd(540e9, 780e9) / 1e24, 2) == 2.53  # 2.527e24, quoted to 3 digits
    # The GPT-3-like config has 175B parameters to within 1%, so 6 N D lands on the seed figure.
    assert six_nd(count_params(GPT3), 300e9) == pytest.approx(3.15e23, rel=0.01)


def test_model_flops_are_six_n_plus_attention_for_a_dense_model():
    """Every matrix weight except the input embedding is multiplied once per token: 6 (N - N_emb)
    plus the attention term (PaLM, appendix B), when embeddings are untied."""
    cfg = get_preset("llama3-8b")
    s = 4096
    n_matmul = count_params(cfg) - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    attention = 3 * cfg.n_layers * 2 * cfg.n_heads * 2 * cfg.head_dim * s / 2
    assert flops_per_token(cfg, s) == pytest.approx(6 * n_matmul + attention, rel=1e-12)


def test_moe_counts_only_the_active_experts():
    cfg = get_preset("mixtral-8x7b")
    dense = ModelConfig(**{**cfg.to_dict(), "moe": None, "family": "mistral"})
    e = cfg.moe
    extra = cfg.n_layers * 6 * cfg.dim * (e.top_k * 3 * e.ffn_dim - 3 * cfg.ffn_dim + e.num_experts)
    assert flops_per_token(cfg, 4096) - flops_per_token(dense, 4096) == pytest.approx(extra, rel=1e-12)


def test_recomputation_adds_forward_work():
    cfg = get_preset("tiny-moe")
    s = 128
    assert recompute_flops_per_token(cfg, s, "none") == 0
    full = recompute_flops_per_token(cfg, s, "full")
    assert full == pytest.approx(forward_flops_per_token(cfg, s) - 2 * cfg.vocab_size * cfg.dim)
    every_other = recompute_flops_per_token(get_preset("tiny-deepseek"), s, "full", interval=2)
    assert 0 < every_other < recompute_flops_per_token(get_preset("tiny-deepseek"), s, "full")
    selective = recompute_flops_per_token(cfg, s, "selective")
    assert 0 < selective < full
    assert recompute_flops_per_token(cfg, s, "selective", interval=2) == pytest.approx(selective / 2)  # 1 of 2 layers
    with pytest.raises(ConfigError, match="one of none, selective, op, full"):
        recompute_flops_per_token(cfg, s, "some")
    with pytest.raises(ConfigError, match="recompute_save"):  # the op policy's FLOPs are the planner's
        recompute_flops_per_token(cfg, s, "op")


def test_mfu_is_model_flops_over_peak():
    cfg = get_preset("llama3-8b", moe=None)
    tps = 5762 * 8  # torchtitan, Llama-3.1-8B on 8 H100s with FSDP: 5,762 tokens/s per GPU
    value = mfu(tps, cfg, 8192, 8 * 989e12)
    assert value == pytest.approx(5762 * flops_per_token(cfg, 8192) / 989e12)
    assert 0.25 < value < 0.4  # torchtitan reports 33-39% MFU (its convention differs slightly)

