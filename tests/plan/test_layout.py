"""Layouts, workloads and clusters: divisibility rules with messages that name the dimension,
stage placement, and the units the command line accepts."""

from __future__ import annotations

import pytest

from tessera.config import get_preset
from tessera.config.errors import ConfigError, ParallelError
from tessera.config.parallel import ParallelConfig
from tessera.plan.cluster import Cluster, parse_bytes, parse_rate
from tessera.plan.layout import Layout, Workload, check_layout, layout_problems, stage_layers


def test_problems_name_each_dimension_that_does_not_divide():
    cfg = get_preset("mixtral-8x7b")
    work = Workload(seq_len=4096, micro_batch=3, global_batch=64)
    lay = Layout(tp=3, pp=64, dp_shard=4, ep=3, cp=3)
    problems = " | ".join(layout_problems(cfg, lay, work))
    for text in ("tp=3 does not divide model.n_heads=32", "tp=3 does not divide model.n_kv_heads=8",
                 "ep=3 does not divide model.moe.num_experts=8", "64 pipeline stages is more than model.n_layers=32",
                 "cp=3 does not divide sequence length (train.seq_len)=4096",
                 "global_batch=64 is not a multiple of micro_batch x dp"):
        assert text in problems
    with pytest.raises(ParallelError, match="tp=3"):
        check_layout(cfg, lay, work)


def test_dense_models_refuse_expert_parallelism_and_sp_needs_tp():
    cfg = get_preset("llama3-8b")
    work = Workload(4096, 1, 8)
    assert "ep=2 needs an MoE model" in " ".join(layout_problems(cfg, Layout(ep=2, dp_shard=2), work))
    assert "sp=true needs tp > 1" in " ".join(layout_problems(cfg, Layout(sp=True), work))


def test_pipelines_need_a_micro_batch_count_their_schedule_runs():
    """The trainer's rule: m >= pp, and round-based schedules need m in [pp, 2 pp) or a multiple of m // pp."""
    cfg = get_preset("llama3-8b")
    lay = Layout(pp=4, vpp=2, pp_schedule="interleaved_1f1b")
    assert any("fewer than pp=4" in p for p in layout_problems(cfg, lay, Workload(4096, 1, 3)))
    assert any("rounds of equal size" in p for p in layout_problems(cfg, lay, Workload(4096, 1, 9)))
    for m in (4, 6, 8, 10, 12):
        assert not layout_problems(cfg, lay, Workload(4096, 1, m)), m
    assert any("fewer than pp=4" in p for p in layout_problems(cfg, Layout(pp=4), Workload(4096, 1, 2)))
    assert not layout_problems(cfg, Layout(pp=4, pp_schedule="gpipe"), Workload(4096, 1, 2))


def test_from_parallel_fills_dp_shard_and_checks_the_world():
    lay = Layout.from_parallel(ParallelConfig(tp=8, pp=2), 64)
    assert (lay.tp, lay.pp, lay.dp_shard, lay.world, lay.dp) == (8, 2, 4, 64, 4)
    with pytest.raises(ParallelError, match="world has 64"):
        Layout.from_parallel(ParallelConfig(tp=8, dp_shard=4), 64)
    assert lay.to_parallel().tp == 8


def test_stage_layers_even_uneven_and_interleaved():
    assert stage_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stage_layers(61, 4)[0] == list(range(16)) and len(stage_layers(61, 4)[3]) == 15
    assert stage_layers(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert sorted(sum(stage_layers(61, 8, 2), [])) == list(range(61))


def test_units():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141GB") == 141e9
    assert parse_bytes(1024) == 1024
    assert parse_rate("450GB/s", "bw", "B/s") == 450e9
    assert parse_rate("989e12", "flops", "FLOP/s") == 989e12
    assert parse_rate("3.35TB/s", "bw", "B/s") == 3.35e12
    assert parse_rate("989T", "flops", "FLOP/s") == 989e12
    with pytest.raises(ConfigError, match="--gpu-memory"):
        parse_bytes("80 parsecs", "--gpu-memory")
    with pytest.raises(ConfigError, match="must be > 0"):
        parse_rate("0", "bw", "B/s")


def test_cluster_validation():
    with pytest.raises(ConfigError, match="gpus=12"):
        Cluster(gpus=12, gpus_per_node=8)
    with pytest.raises(ConfigError, match="efficiency"):
        Cluster(gpus=8, efficiency=1.5)
    assert Cluster(gpus=4).usable_memory == 77 * 2**30
