"""Multi-token prediction (model.mtp_depth) under layouts trains like one process: the MTP modules
cut like the main blocks by tensor (and sequence) parallelism, sharded by FSDP, their MoE block's
experts spread over ranks, and under pipeline parallelism on the last stage, which then holds the
embedding too (its gradient summed with the first stage's, as tied embeddings are), and under
context parallelism, whose shift by k reaches token ids on the other cp ranks (contiguous and
zig-zag splits). The logged loss, mtp_loss and mtp_loss/{k}, gradient norms and final weights
equal the one-process run's, fp32 within 1e-5, through the real Trainer on forked gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.models.chunked_cross_entropy import IGNORE_INDEX
from tessera.models.mtp import depth_targets
from tessera.parallel.context_parallel import ChunkTokens
from tessera.parallel.sequence_layout import take_rank_tokens
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 3
MTP = {"model.mtp_depth": 2, "model.mtp_loss_weight": 0.3}
CP2 = {"parallel.cp": 2, "parallel.dp_shard": 1}


def _assert_same_mtp_losses(got: list[dict], ref: dict, depth: int) -> None:
    for r, w in zip(got[0]["records"], ref["records"], strict=True):
        for key in ["mtp_loss", *(f"mtp_loss/{k}" for k in range(1, depth + 1))]:
            assert w[key] > 0
            assert abs(r[key] - w[key]) <= 1e-5 * w[key], (key, r[key], w[key])


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", [
    pytest.param("dense", 2, {"parallel.dp_shard": 2}, id="dense-fsdp2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="dense-tp2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, id="dense-tp2-sp"),
    pytest.param("dense", 2, {"parallel.pp": 2, "parallel.dp_shard": 1}, id="dense-pp2"),
    pytest.param("moe", 2, {"parallel.ep": 2, "parallel.dp_shard": 2}, id="moe-ep2-fsdp2"),
    pytest.param("deepseek", 2, {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "1f1b"},
                 id="deepseek-pp2-1f1b", marks=pytest.mark.slow),
    pytest.param("deepseek", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1},
                 id="deepseek-tp2-sp", marks=pytest.mark.slow),
    pytest.param("dense", 4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 1},
                 id="dense-pp2-tp2", marks=pytest.mark.slow),
    # Context parallelism: contiguous chunks (all-to-all), the zig-zag split (ring, all-gather),
    # and cp with tp, dp_shard, ep and pp as the context-parallel trainer tests combine them.
    pytest.param("dense", 2, CP2, id="dense-cp2"),
    pytest.param("dense", 2, {**CP2, "parallel.cp_method": "ring"}, id="dense-cp2-ring"),
    pytest.param("moe", 2, {**CP2, "parallel.cp_method": "allgather"}, id="moe-cp2-allgather"),
    pytest.param("dense", 4, {**CP2, "parallel.tp": 2}, id="dense-cp2-tp2"),
    pytest.param("moe", 4, {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.ep": 4}, id="moe-cp2-fsdp2-ep4",
                 marks=pytest.mark.slow),
    pytest.param("dense", 4, {**CP2, "parallel.pp": 2, "parallel.pp_schedule": "1f1b", "parallel.cp_method": "ring"},
                 id="dense-pp2-cp2-ring", marks=pytest.mark.slow),
    pytest.param("deepseek", 2, {**CP2, "parallel.cp_method": "ring"}, id="deepseek-cp2-ring",
                 marks=pytest.mark.slow),
])
def test_multi_token_prediction_under_a_layout_trains_like_one_process(model, world, parallel, small_dataset,
                                                                       tmp_path):
    ref = train_one_process(model, overrides_for(model, small_dataset, tmp_path / "one", STEPS, **MTP))
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, small_dataset, tmp_path / "ranks", STEPS, **MTP, **parallel))
    assert_same_training(got, ref, rtol=1e-5)
    _assert_same_mtp_losses(got, ref, MTP["model.mtp_depth"])
    assert any(name.startswith("mtp.2.block.") for name in ref["weights"])


def _shifted_on_rank(layout: str, S: int) -> dict:
    """This cp rank's ids and targets at every depth, shifted through `ChunkTokens`."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 100, (2, S), generator=gen)
    seq = ChunkTokens(dist.group.WORLD, rank, dist.get_world_size(), layout)
    mine = take_rank_tokens(ids, seq.cp, rank, layout)
    return {"whole": seq.whole(mine), "shifted": [seq.own(depth_targets(seq.whole(mine), k)) for k in (1, 2, 3)]}


@pytest.mark.dist
@pytest.mark.parametrize("layout,cp", [("contiguous", 2), ("zigzag", 2), ("zigzag", 4)])
def test_chunk_tokens_shift_across_context_parallel_ranks_like_one_process(layout, cp):
    """Each rank's ids shifted by k through the cp token exchange are that rank's positions of the
    one-process shift, including the k positions whose token lives on another rank."""
    S = 16
    ids = torch.randint(1, 100, (2, S), generator=torch.Generator().manual_seed(5))
    got = run_ranks(_shifted_on_rank, cp, layout, S)
    for rank, result in enumerate(got):
        assert torch.equal(result["whole"], ids)
        for k, shifted in zip((1, 2, 3), result["shifted"], strict=True):
            want = take_rank_tokens(depth_targets(ids, k), cp, rank, layout)
            assert torch.equal(shifted, want), (rank, k)
    # Depth 1: only the two sequences' last positions have no target; a shift inside each rank's
    # chunks would leave one at every chunk's end instead.
    assert sum(int((r["shifted"][0] == IGNORE_INDEX).sum()) for r in got) == 2


def test_distillation_with_mtp_is_refused_by_name(tmp_path):
    from tessera.config.errors import ConfigError
    from tessera.config.schema import load_config
    from tests.train.runs import TINY_DENSE

    with pytest.raises(ConfigError, match=r"model.mtp_depth=1 is invalid: 0 with train.distill.teacher"):
        load_config(TINY_DENSE, [f"train.distill.teacher={tmp_path}", "model.mtp_depth=1"])
