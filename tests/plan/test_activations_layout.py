"""Per-rank activation bytes under TP, SP, CP, PP and EP.

These layouts cannot run yet (parallelism comes later), so the per-rank figures here are derived
analytically from single-process counts on CPU (tests/plan/activation_measurement.py):
- TP/SP: each tensor the model actually saves is assigned to a rank by Megatron's partitioning
  rules read off its shape (head, FFN and vocabulary dimensions are cut by tp; hidden-size tensors
  of the norm/residual region are cut along the sequence by sequence parallelism; routed-token rows,
  which expert TP needs whole, and integer ids are not cut), and the rank's share is summed.
- CP: a context-parallel rank keeps what one process keeps for seq/cp tokens of each sequence
  (flash attention stores no s x s term; other ranks' keys/values are transient).
- PP: a stage keeps its layers' bytes (measured layer by layer, by difference of layer counts),
  plus the head on the last stage, times the micro-batches in flight.
- EP: with balanced routing a rank computes as many rows as it routes, so the stored bytes do not
  change; the all-to-all buffers are counted apart.
Real multi-rank measurements will replace these derivations once the parallel layer exists.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.config import MoEConfig, get_preset
from tessera.models import Transformer
from tessera.plan.activations import (
    in_flight_microbatches,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    stage_activations,
)
from tessera.plan.layout import Layout, Workload
from tessera.plan.saved.activation_terms import head_saved_tensors, layer_saved_tensors, model_saved_tensors
from tessera.plan.saved_tensors import SavedTensorCounter
from tests.plan.activation_measurement import measure_activation_bytes

B, S = 2, 64
T = B * S
# Sizes chosen distinct so a tensor's role shows in its shape: hidden 48, q 64, kv 32, ffn 80,
# expert ffn 40, vocab 256, 8 experts, top-2 (256 routed rows).
DENSE = get_preset("tiny-llama", dim=48, head_dim=16, ffn_dim=80)
MOE = get_preset("tiny-moe", dim=48, head_dim=16, ffn_dim=80,
                 moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=40, aux_loss_coef=0.01, z_loss_coef=1e-3))


def rank_share(entry, cfg, tp: int, sp: bool) -> float:
    """Bytes of a measured saved tensor that one of tp ranks keeps, from its shape."""
    shape, n = entry.shape, entry.nbytes
    routed = T * cfg.moe.top_k if cfg.moe is not None else -1
    tp_dims = {cfg.ffn_dim, cfg.vocab_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim}
    if cfg.moe is not None:
        tp_dims.add(cfg.moe.ffn_dim)
    if entry.dtype == torch.int64 and shape in ((B, S), (T,)):
        return n  # token ids and targets
    if len(shape) >= 3 and shape[-1] == cfg.head_dim and shape[-2] == 1:
        return n  # RoPE tables [B, S, 1, D]
    if len(shape) == 4 or (len(shape) == 3 and shape[1] == cfg.n_heads and shape[2] == S):
        return n / tp  # per-head attention tensors and the log-sum-exp
    if len(shape) >= 2 and shape[-1] in tp_dims:
        return n / tp  # column-parallel outputs (experts' too), the vocabulary-parallel log-softmax
    if not shape or shape[0] == routed or (len(shape) == 1 and shape[0] != T):
        return n  # routed rows, their indices and gates, fixed-size statistics and scalars
    return n / tp if sp else n  # hidden-size and per-token tensors of the norm/residual/router region


def predicted_rank_bytes(cfg, dtype: str, tp: int, sp: bool) -> float:
    terms = model_saved_tensors(cfg, dtype) + head_saved_tensors(cfg, dtype)
    for i in range(cfg.n_layers):
        terms += layer_saved_tensors(cfg, i, dtype, tokens=T, batch=B)
    return sum(t.nbytes(T, tp, sp) for t in terms)


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "autocast-bf16"])
def test_tensor_and_sequence_parallel_share_from_measured_tensors(cfg, sp, dtype):
    counter = measure_activation_bytes(cfg, dtype, "none", B, S)
    tp = 2
    derived = sum(rank_share(e, cfg, tp, sp) for e in counter.kept)
    assert predicted_rank_bytes(cfg, dtype, tp, sp) == pytest.approx(derived, rel=1e-9)


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_context_parallel_rank_keeps_what_a_shorter_sequence_keeps(cfg):
    cp = 2
    measured = measure_activation_bytes(cfg, "autocast-bf16", "none", B, S // cp).total_bytes
    (stage,) = stage_activations(cfg, Layout(cp=cp), Workload(S, B, B), "autocast-bf16")
    assert stage.stored == pytest.approx(measured, rel=1e-9)


def _head_bytes(cfg, dtype: str) -> int:
    model = Transformer(cfg)
    hidden = torch.randn(B, S, cfg.dim, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (B, S))
    with SavedTensorCounter(model) as c, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != "fp32"):
        logits = model.lm_head(model.norm(hidden))
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), targets.reshape(-1),
                                                 reduction="sum")
    loss.backward()
    return c.total_bytes


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b"])
def test_pipeline_stages_from_layer_by_layer_counts(schedule):
    dtype = "autocast-bf16"
    counts = {n: measure_activation_bytes(dataclasses.replace(MOE, n_layers=n), dtype, "none", B, S).total_bytes
              for n in (1, 2)}
    layer = counts[2] - counts[1]
    head = _head_bytes(MOE, dtype)  # final norm (keeping its input, the last layer's output), head, loss
    const = counts[1] - layer - head
    cfg = dataclasses.replace(MOE, n_layers=8)
    pp, m = 2, 4
    lay = Layout(pp=pp, pp_schedule=schedule, vpp=2 if schedule == "interleaved_1f1b" else 1, dp_shard=1)
    stages = stage_activations(cfg, lay, Workload(S, B, B * m), dtype)
    for s, st in enumerate(stages):
        flight = in_flight_microbatches(schedule, pp, m, lay.vpp, s)
        want = flight * (4 * layer + const + (head if s == pp - 1 else 0))
        assert st.stored == pytest.approx(want, rel=1e-9), s


def test_expert_parallel_keeps_the_same_rows_and_adds_dispatch_buffers():
    work = Workload(S, B, 2 * B)
    one = stage_activations(MOE, Layout(dp_shard=2), work, "bf16")[0]
    two = stage_activations(MOE, Layout(dp_shard=2, ep=2), work, "bf16")[0]
    assert two.stored == one.stored
    assert one.dispatch_buffer == 0
    assert two.dispatch_buffer == 2 * T * MOE.moe.top_k * MOE.dim * 2


def test_sequence_parallel_divides_a_dense_layer_by_t():
    """Korthikanti et al. 2022, table 2: with tensor + sequence parallelism every activation of the
    layer is divided by t; with full recomputation only the input stays, 2 s b h bytes in 16-bit
    (divided by t under sequence parallelism)."""
    cfg, work = get_preset("llama3-8b"), Workload(4096, 1, 8)
    single = layer_activation_bytes(cfg, 0, Layout(), work, "bf16")
    assert layer_activation_bytes(cfg, 0, Layout(tp=4, sp=True), work, "bf16") == pytest.approx(single / 4)
    tp_only = layer_activation_bytes(cfg, 0, Layout(tp=4), work, "bf16")
    assert single / 4 < tp_only < single
    for t, sp in ((1, False), (4, True)):
        full = layer_activation_bytes(cfg, 0, Layout(tp=t, sp=sp), work, "bf16", recompute="full")
        assert full == korthikanti_layer_bytes(4096, 1, cfg.dim, cfg.n_heads, t=t, sp=sp, recompute="full")


def test_korthikanti_formulas():
    """Table 2 of Korthikanti et al. 2022; for GPT-3 (h = 12288, a = 96, s = 2048) the attention
    scores term 5as/h is 80, more than twice the 34 of everything else: what selective
    recomputation removes."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + 80)
    assert korthikanti_layer_bytes(s, b, h, a, t=t) == pytest.approx(sbh * (10 + 24 / t + 80 / t))
    assert korthikanti_layer_bytes(s, b, h, a, t=t, sp=True) == pytest.approx(sbh / t * (34 + 80))
    assert korthikanti_layer_bytes(s, b, h, a, t=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert korthikanti_layer_bytes(s, b, h, a, t=t, sp=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert korthikanti_layer_bytes(s, b, h, a, recompute="full") == 2 * sbh


def test_our_layer_is_cheaper_than_gpts_because_flash_attention_keeps_no_scores():
    """Same shape, bf16: our LLaMA layer keeps far less than GPT's 34 + 5as/h (no s x s scores,
    no dropout masks) but more than GPT's selective-recompute 34 (SwiGLU's wider FFN, fp32 norms)."""
    cfg = get_preset("llama2-7b")
    work = Workload(4096, 1, 1)
    ours = layer_activation_bytes(cfg, 0, Layout(), work, "bf16")
    sbh = 4096 * cfg.dim
    assert 34 * sbh < ours < korthikanti_layer_bytes(4096, 1, cfg.dim, cfg.n_heads)


def test_recurrent_layers_keep_the_handed_on_states_under_cp():
    """Under cp a recurrent layer keeps for backward its state handoff's gathered buffers (every part's
    conv inputs, transitions and end states: states, not keys and values, so the same at 4x the
    sequence), beside its layer's own tensors; none under full recomputation (the block re-runs), in
    host memory under activation offload. Qwen3-Next-80B, cp=4: 36 DeltaNet layers, 4 parts."""
    from tessera.plan.activations import handoff_saved_bytes
    from tessera.plan.profile import ModelProfile

    cfg = get_preset("qwen3-next-80b-a3b")
    lay, work = Layout(cp=4, dp_shard=16), Workload(4096, 1, 64)
    per_layer = 4 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 2 * 32 * 128 * 128 * 4)
    prof = ModelProfile.of(cfg, work.seq_len)
    assert handoff_saved_bytes(cfg, lay, work, "bf16", prof, 0) == 36 * per_layer
    (got,) = stage_activations(cfg, lay, work, "bf16")
    layers = sum(layer_activation_bytes(cfg, i, lay, work, "bf16") for i in range(cfg.n_layers))
    assert got.per_microbatch - layers == pytest.approx(36 * per_layer)
    longer = Workload(4 * 4096, 1, 64)
    assert handoff_saved_bytes(cfg, lay, longer, "bf16", ModelProfile.of(cfg, longer.seq_len), 0) == 36 * per_layer
    assert handoff_saved_bytes(cfg, Layout(dp_shard=64), work, "bf16", prof, 0) == 0
    assert handoff_saved_bytes(cfg, dataclasses.replace(lay, recompute="full"), work, "bf16", prof, 0) == 0
    (offloaded,) = stage_activations(cfg, dataclasses.replace(lay, activation_offload=True), work, "bf16")
    tables = sum(t.nbytes(4096 / 4) for t in model_saved_tensors(cfg, "bf16") if t.name != "input_ids")
    assert offloaded.offloaded - got.in_flight * (layers + tables) == pytest.approx(36 * per_layer)
