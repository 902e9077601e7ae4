"""The time model: GPU presets, operator times from shapes, collectives from latency + bandwidth,
and overlap only where the schedule allows it."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.config import get_preset
from tessera.config.errors import ConfigError
from tessera.models.flops import attention_matmul_params, mlp_matmul_params
from tessera.plan.cluster import Cluster
from tessera.plan.efficiency import ELEMENTWISE_PASSES_EAGER
from tessera.plan.estimate import make_plan
from tessera.plan.gpus import GPUS, get_gpu
from tessera.plan.layout import Layout, Workload
from tessera.plan.op_time import (
    KERNEL_OVERHEAD,
    attention_rate,
    gemm_time,
    layer_ops,
    layer_time,
    stage_compute_time,
)
from tessera.plan.profile import ModelProfile
from tessera.plan.search import time_components


def test_presets_carry_the_datasheet_figures():
    h100, a100, h800, h200, b200 = (get_gpu(n) for n in ("h100", "a100", "h800", "h200", "b200"))
    assert (h100.peak("bf16"), h100.peak("fp8"), h100.memory_bandwidth, h100.nvlink_bandwidth) == \
        (989e12, 1979e12, 3.35e12, 450e9)
    assert (a100.peak("bf16"), a100.memory, a100.nvlink_bandwidth, a100.network_bandwidth) == \
        (312e12, 80 * 2**30, 300e9, 25e9)
    assert h800.peak("bf16") == h100.peak("bf16") and h800.nvlink_bandwidth == 200e9
    assert h200.memory == 141 * 2**30 and h200.memory_bandwidth == 4.8e12
    assert b200.peak("bf16") == 2250e12 and b200.nvlink_bandwidth == 900e9
    h96 = get_gpu("h100-96gb")  # torchtitan's benchmark GPUs: the H100's compute, 96 GB HBM2e at 2.4 TB/s
    assert (h96.peak("bf16"), h96.memory, h96.memory_bandwidth) == (989e12, 96 * 2**30, 2.4e12)
    assert (a100.host_bandwidth, h100.host_bandwidth) == (32e9, 64e9)  # PCIe Gen4 / Gen5 x16, per direction
    assert set(GPUS) == {"a100", "h100", "h800", "h200", "h100-96gb", "b200"}
    with pytest.raises(ConfigError, match="fp8"):
        a100.peak("fp8")
    with pytest.raises(ConfigError, match="a100, h100, h800, h200, h100-96gb, b200"):
        get_gpu("v100")


def test_cluster_for_gpu_takes_the_preset_and_named_overrides():
    c = Cluster.for_gpu("a100", gpus=16)
    g = get_gpu("a100")
    assert c.gpu_flops == 312e12 and c.gpu_memory == 80 * 2**30 and c.gpu == "a100"
    assert c.intra_node_bandwidth == pytest.approx(g.nvlink_bandwidth * g.nvlink_efficiency)
    assert c.inter_node_bandwidth == pytest.approx(g.network_bandwidth * g.network_efficiency)
    assert Cluster.for_gpu("a100", gpus=16, inter_node_bandwidth=1e9).inter_node_bandwidth == 1e9
    with pytest.raises(ConfigError, match="cluster field 'nvlink'"):
        Cluster.for_gpu("a100", gpus=16, nvlink=1.0)
    assert Cluster.for_gpu("h100", gpus=8) == Cluster(gpus=8)  # the plain defaults are the H100 preset


def test_gemm_rate_grows_with_size_and_reaches_the_sustained_share_of_peak():
    c = Cluster.for_gpu("h100", gpus=8)

    def rate(n: int) -> float:
        return 2 * n**3 / gemm_time(n, n, n, c)

    assert rate(256) < rate(1024) < rate(4096) < rate(16384)
    assert rate(16384) == pytest.approx(c.gpu_flops * c.efficiency, rel=0.01)
    assert 0.3 < rate(1024) / (c.gpu_flops * c.efficiency) < 0.7  # the fixed kernel cost shows on small GEMMs


def test_skinny_grouped_gemm_is_bound_by_reading_its_weights():
    """Few rows per expert: the time is the experts' weights at HBM bandwidth, not their FLOPs."""
    c = Cluster.for_gpu("h100", gpus=8)
    experts, h, f = 64, 4096, 1408
    t = gemm_time(8, f, h, c, batch=experts)
    weights = 2 * h * f * experts
    assert t == pytest.approx(weights / c.memory_bandwidth + KERNEL_OVERHEAD, rel=0.02)
    assert t > 2 * 8 * f * h * experts / (c.gpu_flops * c.efficiency) * 10


def test_moe_layer_time_follows_rows_per_expert():
    """The same FLOPs per token cost more when they are spread over many small experts."""
    c = Cluster.for_gpu("h100", gpus=8)
    cfg = get_preset("qwen3-30b-a3b")
    lay = Layout()
    few_tokens = layer_time(cfg, True, lay, 256, 4096, c)
    many_tokens = layer_time(cfg, True, lay, 16384, 4096, c)
    assert many_tokens.matmul / 16384 < few_tokens.matmul / 256 / 4
    ep = layer_time(cfg, True, dataclasses.replace(lay, ep=8, dp_shard=8), 256, 4096, c)
    assert ep.matmul < few_tokens.matmul  # 8x the rows per expert on 1/8 of the experts


def test_attention_reaches_its_rate_only_at_long_sequences():
    c = Cluster.for_gpu("h100", gpus=8)
    assert attention_rate(c, 512) == pytest.approx(0.5 * c.gpu_flops * c.attention_efficiency)
    assert attention_rate(c, 512) < attention_rate(c, 8192) < c.gpu_flops * c.attention_efficiency


def test_collectives_cost_latency_plus_bandwidth_per_link():
    c = Cluster.for_gpu("h100", gpus=64)
    assert c.collective_time(8, 8, 1) == pytest.approx(3 * c.intra_node_latency, rel=0.01)
    assert c.collective_time(8, 64, 1) == pytest.approx(6 * c.inter_node_latency, rel=0.01)
    big = 1e9
    assert c.collective_time(big, 8, 1) == pytest.approx(big / c.intra_node_bandwidth, rel=0.01)
    assert c.collective_time(big, 8, 8) == pytest.approx(big / c.inter_node_bandwidth, rel=0.01)
    assert c.collective_time(big, 1, 1) == 0.0


def _deepseek_plan(**overlap):
    lay = Layout(pp=16, pp_schedule="dualpipe", dp_shard=128, ep=64, zero_stage=1, **overlap)
    return make_plan(get_preset("deepseek-v3"), lay, Workload(4096, 1, 15360), Cluster.for_gpu("h800", gpus=2048),
                     activation_dtype="bf16")


def test_expert_all_to_all_is_exposed_unless_the_schedule_overlaps_it():
    plain, overlapped = _deepseek_plan(), _deepseek_plan(ep_overlap=True)
    exposed, hidden = time_components(plain)["ep comm"], time_components(overlapped).get("ep comm", 0.0)
    assert exposed > 0.3 * plain.time.total  # the all-to-all across 8 nodes dominates without overlap
    assert hidden < exposed / 2
    assert overlapped.tokens_per_second > 1.4 * plain.tokens_per_second
    assert "a2a-overlap" in overlapped.layout.describe()


def test_tensor_parallel_traffic_hides_behind_gemms_only_when_asked():
    cfg, work = get_preset("llama3-70b"), Workload(4096, 1, 64)
    lay = Layout(tp=8, sp=True, pp=1, dp_shard=8, zero_stage=3, recompute="full")
    plain = make_plan(cfg, lay, work, Cluster.for_gpu("h100", gpus=64))
    overlapped = make_plan(cfg, dataclasses.replace(lay, tp_overlap=True), work, Cluster.for_gpu("h100", gpus=64))
    assert time_components(plain)["tp comm"] > 0
    assert time_components(overlapped).get("tp comm", 0.0) < time_components(plain)["tp comm"]
    assert overlapped.time.total < plain.time.total


def test_faster_gpus_make_faster_steps_and_mfu_uses_their_peak():
    cfg, work = get_preset("llama3-8b"), Workload(4096, 1, 64)
    lay = Layout(dp_shard=8, recompute="selective")
    plans = {g: make_plan(cfg, lay, work, Cluster.for_gpu(g, gpus=8)) for g in ("a100", "h100", "b200")}
    assert plans["a100"].time.total > plans["h100"].time.total > plans["b200"].time.total
    for g, p in plans.items():
        assert p.mfu == pytest.approx(p.model_flops_per_step / (p.time.total * 8 * get_gpu(g).peak("bf16")))
        assert 0.2 < p.mfu < get_gpu(g).matmul_efficiency


def test_layer_time_is_the_sum_of_its_printed_operators():
    c = Cluster.for_gpu("h100", gpus=8)
    for preset, moe in (("llama3-8b", False), ("mixtral-8x7b", True), ("deepseek-v3", True)):
        cfg = get_preset(preset)
        lay = Layout(ep=8, dp_shard=8) if moe else Layout(tp=2, sp=True, dp_shard=4)
        ops = layer_ops(cfg, moe, lay, 8192, 8192, c)
        t = layer_time(cfg, moe, lay, 8192, 8192, c)
        assert t.forward == pytest.approx(sum(o.seconds for o in ops))
        assert {o.kind for o in ops} == {"matmul", "attention", "memory"}
        matmul_flops = sum(o.flops for o in ops if o.kind == "matmul")
        layer = cfg.moe_layers[0] if moe else 0
        per_token = 2 * (attention_matmul_params(cfg) + mlp_matmul_params(cfg, layer)) / lay.tp
        assert matmul_flops == pytest.approx(per_token * 8192, rel=0.01)  # the FLOP count behind MFU


def test_collectives_sharing_a_window_share_it():
    """ZeRO-3 gathers and an overlapped all-to-all both run under the micro-batch: only what exceeds
    the micro-batch's compute is exposed, however the traffic splits between them."""
    cfg, work = get_preset("mixtral-8x7b"), Workload(4096, 1, 256)
    lay = Layout(dp_replicate=2, dp_shard=32, ep=8, zero_stage=3, recompute="full", ep_overlap=True)
    plan = make_plan(cfg, lay, work, Cluster.for_gpu("h100", gpus=64, inter_node_bandwidth=5e9))
    st = plan.time.stages[0]
    windowed = ("dp_shard", "ep_dp", "ep")
    cluster = plan.cluster
    # the per-micro-batch traffic of those groups (weight gathers, the all-to-all); the gradient
    # reduce-scatters run once per step, in the last backward, and are not in this window
    link = sum(cluster.collective_time(c.bytes_per_call(), c.group_size, c.stride) * c.calls_per_microbatch
               for c in plan.collectives[0] if c.group in windowed)
    exposed = sum(st.exposed.get(g, 0.0) for g in windowed)
    assert link > st.compute  # a slow network: the window is too small
    assert exposed == pytest.approx(link - st.compute, rel=1e-6)


def test_pipeline_sends_hide_only_under_schedules_that_overlap_them():
    cfg, work = get_preset("llama3-70b"), Workload(4096, 1, 64)
    cluster = Cluster.for_gpu("h100", gpus=64)
    plain = make_plan(cfg, Layout(tp=8, sp=True, pp=8, recompute="full"), work, cluster)
    interleaved = make_plan(cfg, Layout(tp=8, sp=True, pp=8, vpp=2, pp_schedule="interleaved_1f1b",
                                        recompute="full"), work, cluster)
    assert time_components(plain)["pp comm"] > 0
    assert "pp comm" not in time_components(interleaved)


def test_fused_attention_backward_computes_the_scores_again():
    # FlashAttention's backward: five products against the forward's two (q k^T again, then the
    # gradients of p, v, q, k), so forward + backward is 1 + 2.5 forwards; without fusion the scores
    # are kept and backward is the 2:1 of the FLOP count.
    c, cfg = Cluster.for_gpu("h100", gpus=1), get_preset("llama3-8b")
    work = Workload(seq_len=4096, micro_batch=1, global_batch=1)
    for fused, passes in ((True, 3.5), (False, 3.0)):
        lay = Layout(fused_attention=fused)
        forward = layer_time(cfg, False, lay, 4096, 4096, c, "bf16").attention
        step = stage_compute_time(cfg, lay, work, 0, c, ModelProfile.of(cfg, 4096), "bf16")
        assert step.attention == pytest.approx(cfg.n_layers * passes * forward)


def test_eager_profile_counts_torchtitans_elementwise_kernels():
    # Bytes per token of torchtitan's eager Llama block (efficiency.py) over the time model's one pass
    for preset, passes in (("llama3.1-8b", 3.24), ("llama3-70b", 3.21)):
        cfg = get_preset(preset)
        h, q, kv, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
        assert (84 * h + 24 * q + 24 * kv + 10 * f) / (20 * h + 4 * q + 4 * kv + 6 * f) == pytest.approx(passes,
                                                                                                     abs=0.005)
    cfg, lay = get_preset("llama3.1-8b"), Layout()
    eager, compiled = (Cluster.for_gpu("h100-96gb", gpus=1, profile=p) for p in ("torch-eager", "tessera"))
    assert eager.elementwise_passes == ELEMENTWISE_PASSES_EAGER == 3.24
    assert eager.attention_efficiency == compiled.attention_efficiency == 0.35  # both run torch's SDPA
    ratio = (layer_time(cfg, False, lay, 8192, 8192, eager, "bf16").memory
             / layer_time(cfg, False, lay, 8192, 8192, compiled, "bf16").memory)
    assert ratio == pytest.approx(ELEMENTWISE_PASSES_EAGER / 2)


def test_context_parallel_recurrent_layers_add_their_handoffs_products():
    """Under cp a Gated DeltaNet layer runs the delta rule over V + K value columns (6 K K more per head
    and token), adds each token's share of its start state (2 K V) and scans the earlier parts' states
    (up to cp products of a K x K transition and a K x V state per sequence, and its own); Qwen3-Next-80B
    at cp=4: 32 value heads of 128 x 128 on each of 36 layers. The plan's hardware FLOPs and the stage's
    product time grow by that; an attention-only model's do not change with cp's handoff."""
    from tessera.plan.estimate import handoff_flops_per_token
    from tessera.plan.op_time import handoff_time
    from tessera.plan.profile import handoff_flops

    cfg = get_preset("qwen3-next-80b-a3b")
    lay, work = Layout(cp=4, dp_shard=16), Workload(4096, 1, 64)
    K = 128
    per_rank = 1024 * 32 * (6 * K * K + 2 * K * K) + (4 + 1) * 2 * 32 * K * K * K
    assert handoff_flops(cfg, "delta", lay, 1, 4096) == per_rank
    assert handoff_flops_per_token(cfg, lay, work) == pytest.approx(36 * 3 * per_rank * 4 / 4096)
    cluster = Cluster.for_gpu("h100", gpus=64)
    prof = ModelProfile.of(cfg, work.seq_len)
    assert handoff_time(cfg, lay, work, 0, cluster, prof) == pytest.approx(
        36 * 3 * per_rank / (cluster.gpu_flops * cluster.efficiency))
    plan = make_plan(cfg, lay, work, cluster)
    no_handoff = make_plan(dataclasses.replace(cfg, linear_attention=None), lay, work, cluster)
    assert plan.hardware_flops_per_step - plan.model_flops_per_step == pytest.approx(
        handoff_flops_per_token(cfg, lay, work) * work.tokens)
    assert no_handoff.hardware_flops_per_step == no_handoff.model_flops_per_step
    assert handoff_time(cfg, Layout(dp_shard=64), work, 0, cluster, prof) == 0


@pytest.mark.parametrize("name,core_re_runs", [("gpt-oss-20b", True), ("llama3-8b", False)])
def test_the_op_policy_re_runs_an_attention_core_with_sinks_whatever_it_keeps(name, core_re_runs):
    """With every product and the attention core kept, recompute=op re-runs nothing of an SDPA core, but all of
    gpt-oss's core with sinks (an explicit softmax, which the policy cannot keep): its recomputed FLOPs are the
    layers' attention cores (models/flops.py) and a layer's recomputed time its core's forward."""
    from tessera.models.flops import attention_core_flops_per_token
    from tessera.plan.estimate import recompute_flops
    from tessera.plan.op_time import recompute_time

    cfg, seq, c = get_preset(name), 4096, Cluster.for_gpu("h100", gpus=8)
    lay = Layout(dp_shard=8, recompute="op", recompute_save=("matmuls", "attention_core"))
    work = Workload(seq_len=seq, micro_batch=1, global_batch=8)
    cores = sum(attention_core_flops_per_token(cfg, seq, layer=i) for i in range(cfg.n_layers))
    assert recompute_flops(cfg, lay, work, "autocast-bf16") == pytest.approx(cores if core_re_runs else 0.0)
    forward = layer_time(cfg, cfg.is_moe_layer(0), lay, seq, seq, c, "autocast-bf16", layer=0)
    again = recompute_time(cfg, cfg.is_moe_layer(0), lay, seq, seq, c, "autocast-bf16", forward, 0)
    assert forward.attention > 0 and again.attention == (forward.attention if core_re_runs else 0.0)
