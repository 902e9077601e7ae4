"""Communication volumes per step: the ratios the papers state, and which link each group uses."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.config import get_preset
from tessera.plan.cluster import Cluster
from tessera.plan.comm import group_strides, stage_collectives
from tessera.plan.layout import Layout, Workload
from tessera.plan.memory import get_precision, rank_params

WORK = Workload(seq_len=4096, micro_batch=1, global_batch=64)


def collectives(cfg, lay, precision="bf16", dtype="bf16", stage=0, work=WORK):
    params = rank_params(cfg, lay)[stage]
    return stage_collectives(cfg, lay, work, stage, params, get_precision(precision), dtype)


def volume(colls, group, m):
    return sum(c.bytes_per_step(m) for c in colls if c.group == group)


def test_tensor_parallel_all_reduces_four_times_per_layer():
    """Megatron TP: two all-reduces of the s b h activations forward and two backward per layer,
    plus the vocabulary-parallel embedding's forward all-reduce; sequence parallelism replaces each
    all-reduce by an all-gather and a reduce-scatter of the same total volume (Korthikanti et al.)."""
    cfg = get_preset("llama3-8b")
    lay = Layout(tp=8, dp_shard=8)
    m = lay.microbatches(WORK)
    tokens_bytes = WORK.micro_batch * WORK.seq_len * cfg.dim * 2
    want = m * (4 * cfg.n_layers + 1) * 2 * 7 / 8 * tokens_bytes
    assert volume(collectives(cfg, lay), "tp", m) == pytest.approx(want)
    sp = dataclasses.replace(lay, sp=True)
    assert volume(collectives(cfg, sp), "tp", m) == pytest.approx(want)
    full = dataclasses.replace(lay, recompute="full")
    with_recompute = want * (6 * cfg.n_layers + 1) / (4 * cfg.n_layers + 1)
    assert volume(collectives(cfg, full), "tp", m) == pytest.approx(with_recompute)


def test_zero3_moves_one_and_a_half_times_data_parallel_traffic():
    """ZeRO (Rajbhandari et al. 2019, section 7): stages 1 and 2 move as much as a data-parallel
    all-reduce (a reduce-scatter plus an all-gather); stage 3 moves 1.5x (the weights are
    all-gathered for forward and again for backward). 16-bit weights and gradients, one micro-batch.
    The trainer keeps the root unit (embedding, final norm, head) gathered from its forward to its
    backward, so under ZeRO-3 the blocks move 1.5x and the root 1x."""
    cfg = get_preset("llama3-8b")
    work = Workload(4096, 1, 64)
    base = Layout(dp_shard=64)
    params = rank_params(cfg, base)[0]
    n, blocks = params.total, params.total - params.root
    allreduce = 2 * 63 / 64 * 2
    for stage, moved in ((1, n), (2, n), (3, n + 0.5 * blocks)):
        lay = dataclasses.replace(base, zero_stage=stage)
        got = volume(collectives(cfg, lay, "bf16-lowp-grads", work=work), "dp_shard", 1)
        assert got == pytest.approx(allreduce * moved), stage


def test_hybrid_sharding_all_reduces_the_shard_across_replicas():
    cfg = get_preset("llama3-8b")
    lay = Layout(dp_replicate=8, dp_shard=8, zero_stage=1)
    n = rank_params(cfg, lay)[0].total
    got = volume(collectives(cfg, lay, "bf16"), "dp_replicate", lay.microbatches(WORK))
    assert got == pytest.approx(2 * 7 / 8 * 4 * n / 8)  # fp32 gradients, one shard of 8


def test_expert_parallel_all_to_alls_and_pipeline_sends():
    cfg = get_preset("mixtral-8x7b")
    lay = Layout(pp=2, pp_schedule="interleaved_1f1b", vpp=2, dp_shard=32, ep=8)
    m = lay.microbatches(WORK)
    colls = collectives(cfg, lay)
    rows = WORK.seq_len * cfg.moe.top_k * cfg.dim * 2
    assert volume(colls, "ep", m) == pytest.approx(m * 4 * (cfg.n_layers // 2) * 7 / 8 * rows)
    assert volume(colls, "pp", m) == pytest.approx(m * 2 * 2 * WORK.seq_len * cfg.dim * 2)


def test_context_parallel_all_to_all_when_cp_divides_the_heads():
    """Ulysses: per layer q, k, v out and the output back, forward and backward, each an all-to-all
    of the rank's T = seq/cp tokens sending (cp-1)/cp of the buffer. LLaMA-3-8B: 32 q heads, 8 kv."""
    cfg = get_preset("llama3-8b")
    lay = Layout(cp=4, dp_shard=16)
    m = lay.microbatches(WORK)
    T = WORK.micro_batch * WORK.seq_len / 4
    buffer = T * (2 * 32 + 2 * 8) * cfg.head_dim * 2
    colls = [c for c in collectives(cfg, lay) if c.group == "cp"]
    assert {c.op for c in colls} == {"all-to-all"}
    assert volume(colls, "cp", m) == pytest.approx(m * 2 * cfg.n_layers * 3 / 4 * buffer)


def test_context_parallel_ring_passes_key_value_blocks_and_their_gradients():
    """cp_method=ring: per layer the rank's k/v block of T = seq/cp tokens makes cp-1 hops forward and
    cp-1 backward (bf16), and its fp32 gradient accumulator cp hops backward."""
    cfg = get_preset("llama3-8b")
    lay = Layout(cp=4, dp_shard=16, cp_method="ring")
    m = lay.microbatches(WORK)
    block = WORK.micro_batch * WORK.seq_len / 4 * 2 * cfg.n_kv_heads * cfg.head_dim
    colls = [c for c in collectives(cfg, lay) if c.group == "cp"]
    assert {c.op for c in colls} == {"send/recv"} and {c.overlap for c in colls} == {"attention"}
    assert volume(colls, "cp", m) == pytest.approx(m * cfg.n_layers * (3 * 2 * block * 2 + 4 * block * 4))
    allgather = Layout(cp=4, dp_shard=16, cp_method="allgather")  # explicit all-gather even though cp | heads
    assert {c.op for c in collectives(cfg, allgather) if c.group == "cp"} == {"all-gather", "reduce-scatter"}


def test_context_parallel_gathers_keys_and_values_when_heads_do_not_divide():
    cfg = get_preset("llama3-8b")
    lay = Layout(tp=8, cp=8)  # 4 local query heads: cp=8 cannot split them, so k/v are all-gathered
    m = lay.microbatches(WORK)
    kv = WORK.seq_len * 2 * cfg.n_kv_heads * cfg.head_dim * 2 / 8
    assert volume(collectives(cfg, lay), "cp", m) == pytest.approx(m * 3 * cfg.n_layers * 7 / 8 * kv)


def test_groups_use_the_link_their_ranks_sit_on():
    """Ranks are numbered tp fastest, then cp, dp_shard, dp_replicate, pp: a tp group of 8 stays in
    an 8-GPU node, the data-parallel group across tp=8 spans nodes."""
    cl = Cluster(gpus=64)
    lay = Layout(tp=8, dp_shard=8)
    st = group_strides(lay)
    assert cl.group_bandwidth(8, st["tp"]) == cl.intra_node_bandwidth
    assert cl.group_bandwidth(8, st["dp_shard"]) == cl.inter_node_bandwidth
    small = Layout(tp=2, cp=2, dp_shard=16)
    assert cl.group_bandwidth(2, group_strides(small)["cp"]) == cl.intra_node_bandwidth
    assert cl.group_bandwidth(1, 1) == float("inf")


def _handoff(colls) -> list:
    return [c for c in colls if c.group == "cp" and "handoff" in c.what]


def test_recurrent_layers_hand_on_states_under_cp_and_only_attention_layers_exchange_keys_and_values():
    """Qwen3-Next-80B under cp=4 (Ulysses): its 36 Gated DeltaNet layers all-gather, per micro-batch, every
    part's last 3 conv inputs (2 x 16 key heads x 128 + 32 value heads x 128 channels, bf16), transitions
    (32 heads x 128 x 128, fp32) and zero-start end states (32 x 128 x 128, fp32), and reduce-scatter their
    gradients, whatever the sequence's length; the all-to-alls run on its 12 attention layers only, as
    much as the same model with those 12 layers alone moves. Under tp=2 the handoff carries half the heads;
    Nemotron-H's Mamba-2 layers hand on a decay per head and a head_dim x state_size state."""
    cfg = get_preset("qwen3-next-80b-a3b")
    lay = Layout(cp=4, dp_shard=16)
    m = lay.microbatches(WORK)
    colls = collectives(cfg, lay)
    per_layer = 4 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 2 * 32 * 128 * 128 * 4)  # 4 parts, one a rank
    assert volume(_handoff(colls), "cp", m) == pytest.approx(m * 36 * 2 * 3 / 4 * per_layer)
    assert {(c.op, c.overlap) for c in _handoff(colls)} == {("all-gather", "none"), ("reduce-scatter", "none")}
    longer = collectives(cfg, lay, work=Workload(seq_len=4 * WORK.seq_len, micro_batch=1, global_batch=64))
    assert volume(_handoff(longer), "cp", m) == volume(_handoff(colls), "cp", m)
    attention_only = dataclasses.replace(cfg, n_layers=12, linear_attention=None)
    exchange = [c for c in colls if c.group == "cp" and c.op == "all-to-all"]
    assert volume(exchange, "cp", m) == pytest.approx(volume(collectives(attention_only, lay), "cp", m))
    tp2 = _handoff(collectives(cfg, Layout(tp=2, cp=4, dp_shard=8)))
    assert volume(tp2, "cp", m) == pytest.approx(volume(_handoff(colls), "cp", m) / 2)
    full = _handoff(collectives(cfg, dataclasses.replace(lay, recompute="full")))  # the forward's gathers again
    assert sum(c.calls_per_microbatch for c in full) == 36 * 3 * 3

    nemotron = get_preset("nemotron-h-8b")
    mamba = sum(1 for i in range(nemotron.n_layers) if nemotron.is_mamba_layer(i))
    mc = nemotron.mamba
    zigzag = Layout(cp=2, dp_shard=32, cp_method="ring")  # two parts a rank
    channels = mc.n_heads * mc.head_dim + 2 * mc.n_groups * mc.state_size
    per_layer = 4 * (channels * (mc.conv_width - 1) * 2 + mc.n_heads * 4 + mc.n_heads * mc.head_dim * mc.state_size * 4)
    assert volume(_handoff(collectives(nemotron, zigzag)), "cp", m) == pytest.approx(m * mamba * 2 / 2 * per_layer)
    attention = sum(1 for i in range(nemotron.n_layers) if nemotron.has_attention(i))
    ring = [c for c in collectives(nemotron, zigzag) if c.op == "send/recv"]
    assert sum(c.calls_per_microbatch for c in ring) == attention * (2 + 2)  # k/v blocks 1 hop x 2, accumulators 2


def test_attention_only_models_hand_on_no_state():
    for name in ("llama3-8b", "deepseek-v3"):
        assert not _handoff(collectives(get_preset(name), Layout(cp=4, dp_shard=16)))
