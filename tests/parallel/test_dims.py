"""ParallelDims: sizes from the config, refusal of layouts the world or the model cannot take
(before any process group exists), and the named mesh with its flattened dimensions."""

import pytest
import torch
import torch.distributed as dist

from tessera.config import ModelConfig, ParallelError, get_preset
from tessera.config.parallel import ParallelConfig
from tessera.parallel import ParallelDims, dp_rows, global_count, shard_global_batch, sum_expert_counts
from tests.forked_ranks import run_ranks


def dims_for(world: int, **kw) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_dp_shard_fills_the_world():
    d = dims_for(8, tp=2, dp_replicate=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (1, 2, 2, 1, 2)
    assert d.size("dp") == 4 and d.size("dp_shard_cp") == 2 and d.size("cp") == 1 and d.dp_size == 4


@pytest.mark.parametrize("world,parallel,model,message", [
    (6, dict(tp=4), {}, "world size 6 is not divisible"),
    (4, dict(tp=2, dp_shard=3), {}, "= 6 ranks, but the world has 4"),
    (3, dict(tp=3, dp_shard=1), {}, "tp=3 does not divide model.n_heads=4"),
    (4, dict(tp=4, dp_shard=1), {"n_kv_heads": 2}, "tp=4 does not divide model.n_kv_heads=2"),
    (2, dict(tp=2, dp_shard=1), {"vocab_size": 255}, "tp=2 does not divide model.vocab_size=255"),
    (2, dict(tp=2, dp_shard=1), {"ffn_dim": 129}, "tp=2 does not divide model.ffn_dim=129"),
    (2, dict(ep=2, dp_shard=2), {}, "ep=2 needs an MoE model"),
    (2, dict(pp=4, dp_shard=1), {}, "world has 2"),
    (4, dict(pp=4, dp_shard=1), {}, "more than model.n_layers=2"),
])
def test_layout_refused_with_dimension_and_numbers(world, parallel, model, message):
    cfg = get_preset("tiny-llama", **model)
    with pytest.raises(ParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dims = dims_for(world, **parallel)
        dims.validate(cfg, world)


@pytest.mark.parametrize("preset,parallel,model", [
    ("tiny-llama", dict(tp=2, dp_shard=1), {"tie_embeddings": True}),
    ("tiny-llama", dict(pp=2, dp_shard=1), {"tie_embeddings": True}),
    ("tiny-deepseek", dict(tp=2, dp_shard=1), {}),  # MLA: heads split, no kv-head count to divide
    ("tiny-deepseek", dict(tp=4, dp_shard=1), {}),
])
def test_tied_embeddings_and_mla_layouts_are_accepted(preset, parallel, model):
    dims = dims_for(parallel["tp"] if "tp" in parallel else parallel["pp"], **parallel)
    dims.validate(get_preset(preset, **model), dims.world_size)


def test_the_sizes_are_the_layout_rules_sizes_with_the_configured_virtual_stages():
    """ParallelDims is the rules' LayoutSizes: validation checks its own vpp unless told another."""
    cfg = get_preset("tiny-llama")  # 2 layers
    dims = dims_for(2, pp=2, vpp=2, pp_schedule="interleaved_1f1b", dp_shard=1)
    assert dims.vpp == 2 and dims.world == 2
    with pytest.raises(ParallelError, match=r"pp x vpp = 2 x 2 = 4 pipeline stages is more than model.n_layers=2"):
        dims.validate(cfg, 2)
    dims.validate(cfg, 2, vpp=1)


@pytest.mark.parametrize("parallel,moe_changes,message", [
    (dict(ep=3, dp_shard=3), {}, "ep=3 does not divide model.moe.num_experts=8"),
    (dict(ep=4, dp_shard=2, tp=2), {}, "ep=4 does not divide dp_shard x cp=2"),
    (dict(tp=2, dp_shard=1), {"ffn_dim": 63}, "tp=2 does not divide model.moe.ffn_dim=63"),
])
def test_moe_layout_refused(parallel, moe_changes, message):
    base = get_preset("tiny-moe")
    cfg = ModelConfig.from_dict({**base.to_dict(), "moe": {**base.to_dict()["moe"], **moe_changes}})
    world = 1
    for k in ("tp", "dp_shard", "dp_replicate", "pp", "cp"):
        world *= parallel.get(k, 1)
    dims = dims_for(world, **parallel)
    with pytest.raises(ParallelError, match=message):
        dims.validate(cfg, world)


def test_sequence_parallel_needs_divisible_sequence():
    dims = dims_for(2, tp=2, sp=True, dp_shard=1)
    dims.validate(get_preset("tiny-llama"), 2, seq_len=16)
    with pytest.raises(ParallelError, match="tp=2 does not divide sequence length"):
        dims.validate(get_preset("tiny-llama"), 2, seq_len=15)


def test_unknown_dimension_name_is_refused():
    with pytest.raises(ParallelError, match="unknown mesh dimension 'dq'"):
        dims_for(1).size("dq")


def _mesh_on_rank():
    dims = dims_for(dist.get_world_size(), tp=2, ep=2)  # dp_shard = 2 fills a world of 4
    dims.build_mesh("cpu")
    batch = torch.arange(8).view(8, 1)
    return {
        "coords": dims.coordinates(),
        "sizes": {n: dims[n].size() for n in ("pp", "dp_replicate", "dp_shard", "dp", "dp_shard_cp",
                                               "ep", "tp", "cp", "dp_shard_mod_ep", "dp_shard_in_ep")},
        "tp_ranks": dims["tp"].mesh.flatten().tolist(),
        "ep_ranks": dims["ep"].mesh.flatten().tolist(),
        "hsdp_ndim": dims["dp_replicate", "dp_shard_cp"].ndim,
        "rows": shard_global_batch(batch, dims).flatten().tolist(),
        "dp_rank": dims.dp_rank,
        "loss_tokens": global_count(3 + dims.dp_rank, dims),  # dp ranks count 3 and 4 tokens
        "expert_counts": sum_expert_counts({1: torch.tensor([dims.dp_rank, 1])}, dims)[1].tolist(),
    }


@pytest.mark.dist
def test_named_mesh_on_four_ranks():
    results = run_ranks(_mesh_on_rank, 4)
    for rank, r in enumerate(results):
        assert r["sizes"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "dp": 2, "dp_shard_cp": 2, "ep": 2,
                              "tp": 2, "cp": 1, "dp_shard_mod_ep": 1, "dp_shard_in_ep": 2}
        assert r["coords"]["tp"] == rank % 2 and r["dp_rank"] == rank // 2  # tp innermost
        assert r["tp_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["ep_ranks"] == [rank % 2, rank % 2 + 2]  # experts fold over dp_shard, same tp rank
        assert r["hsdp_ndim"] == 2
        assert r["rows"] == ([0, 1, 2, 3] if rank < 2 else [4, 5, 6, 7])  # tp peers read the same rows
        assert r["loss_tokens"] == 7 and r["expert_counts"] == [1, 2]  # summed over dp, not over tp


def _cp_mesh_on_rank():
    dims = dims_for(dist.get_world_size(), cp=2)  # dp_shard = 2 fills a world of 4
    dims.build_mesh("cpu")
    inputs = torch.arange(4 * 6).view(4, 6)  # global batch: 4 rows of 6 positions
    return {
        "coords": dims.coordinates(),
        "part": shard_global_batch(inputs, dims).tolist(),
        "loss_tokens": global_count(3 + dims.local_rank("cp"), dims),  # chunks count 3 and 4 tokens
        "expert_counts": sum_expert_counts({1: torch.tensor([dims.dp_rank, 1])}, dims)[1].tolist(),
    }


@pytest.mark.dist
def test_cp_ranks_read_chunks_of_their_rows_and_count_every_token():
    results = run_ranks(_cp_mesh_on_rank, 4)
    for rank, r in enumerate(results):
        dp, cp = rank // 2, rank % 2  # cp inside dp_shard
        assert (r["coords"]["dp_shard_mod_ep"], r["coords"]["cp"]) == (dp, cp)
        rows = torch.arange(24).view(4, 6)[2 * dp:2 * dp + 2]
        assert r["part"] == rows[:, 3 * cp:3 * cp + 3].tolist()  # contiguous chunk of every sequence
        assert r["loss_tokens"] == 14  # summed over dp and cp
        assert r["expert_counts"] == [1, 2]  # over dp only: the router already summed over cp


def test_batch_rows_refuse_indivisible_batch():
    with pytest.raises(ParallelError, match="does not divide the global batch size 3"):
        dp_rows(3, dims_for(2, dp_shard=2))
