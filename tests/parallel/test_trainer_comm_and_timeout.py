"""Communication accounting (`log.comm_stats`) against the bytes the shapes imply, and a stalled
rank turned into an error that names the rank, the phase and the operation."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tessera.config.schema import load_config
from tessera.train.trainer import Trainer
from tests.forked_ranks import RankFailure, run_ranks
from tests.hang_guard import HANG_S
from tests.parallel.trainer_runs import overrides_for, train_on_ranks
from tests.train.runs import TINY_DENSE

F32, F64 = 4, 8  # bytes per element


def _expected_per_rank() -> dict[str, tuple[int, int]]:
    """(calls, payload bytes) one rank moves in one step of the shrunken tiny dense model
    (tests/train/runs.py: dim D=64, L=2 layers, 4 heads of 16 (H*hd = 64), 2 KV heads (G*hd = 32),
    ffn F=128, vocabulary V=4096, seq S=32, global batch 4) under tp=2 x dp_shard=2.

    dp = 2, so each rank reads B=2 rows: one micro-batch of B x S = 64 tokens per step."""
    D, L, Hd, Gd, F, V, B, S, tp = 64, 2, 64, 32, 128, 4096, 2, 32, 2
    # Tensor parallel (DTensor, all-reduce of a [B, S, D] activation or its gradient), per layer:
    # forward wo and w2 (row-parallel outputs), backward the inputs of wq, wk, wv, w1, w3
    # (column-parallel: partial input gradients); plus the embedding's forward (vocab-parallel
    # rows) and the head's backward (column-parallel input). 7 L + 2 all-reduces.
    tp_calls = 7 * L + 2
    tp_bytes = tp_calls * B * S * D * F32
    # Vocabulary-parallel cross-entropy: all-reduce of the max, the sum of exps and the target
    # logit, one fp32 value per token each.
    ce_calls, ce_bytes = 3, 3 * B * S * F32
    # Loss tokens of the global batch (one fp64 over dp), the step's loss statistics (loss sum and
    # aux sum, two fp64 over dp) and the global gradient norm (one fp32 over the world).
    book_calls, book_bytes = 3, F64 + 2 * F64 + F32
    # FSDP2 over dp_shard=2 gathers this rank's tensor-parallel slice of each unit (all sizes are
    # even, so no padding): a block is wq, wk, wv, w1, w3 (column slices), wo, w2 (row slices)
    # and its two norms (whole); the root is embedding and head (vocabulary slices) and the norm.
    block = (Hd * D + 2 * Gd * D + D * Hd + 3 * F * D) // tp + 2 * D
    root = 2 * V * D // tp + D
    # Blocks are gathered in forward and again in backward (zero_stage 3 reshards them); the root
    # stays gathered. Each unit's gradient is reduce-scattered once (one micro-batch).
    gather_calls, gather_bytes = 2 * L + 1, (2 * L * block + root) * F32
    scatter_calls, scatter_bytes = L + 1, (L * block + root) * F32
    return {"all_reduce": (tp_calls + ce_calls + book_calls, tp_bytes + ce_bytes + book_bytes),
            "all_gather": (gather_calls, gather_bytes), "reduce_scatter": (scatter_calls, scatter_bytes)}


@pytest.mark.dist
def test_comm_stats_of_tp2_x_fsdp2_match_the_shapes(small_dataset, tmp_path):
    overrides = overrides_for("dense", small_dataset, tmp_path, 2, **{"parallel.tp": 2, "parallel.dp_shard": 2,
                                                                      "log.comm_stats": True})
    records = run_ranks(train_on_ranks, 4, "dense", overrides)[0]["records"]
    expected = _expected_per_rank()
    world = 4  # every rank has the same shapes, so the sums over ranks are 4 x one rank's figures
    for rec in records:  # the same in every step
        for kind, (calls, nbytes) in expected.items():
            assert rec[f"comm/{kind}_calls"] == world * calls, kind
            assert rec[f"comm/{kind}_bytes"] == world * nbytes, kind
        assert not any(k.startswith(("comm/all_to_all", "comm/send_recv")) for k in rec)
        assert rec["comm/max_rank_bytes"] == sum(b for _, b in expected.values())
        assert rec["comm/total_bytes"] == world * rec["comm/max_rank_bytes"]


def _rank1_stalls(overrides: list[str], checks_in: bool) -> None:
    trainer = Trainer(load_config(TINY_DENSE, overrides))
    if dist.get_rank() == 1:
        if checks_in:  # a step's first collective: the check-in after the batch (tessera.train.run.rank_timing)
            trainer.data.train.next_batch()
            trainer.layout.check_in()
        time.sleep(30)  # alive (its connections stay open) but never enters the step's (next) collectives
        return
    trainer.train_step()


@pytest.mark.dist
@pytest.mark.parametrize("checks_in, phase, operation", [
    (True, "forward/backward", "global_sum"),  # stuck in its forward: rank 0 waits in the loss's all-reduce
    (False, "step check-in", "layout.py:check_in"),  # never starts the step (train/run/layout.py)
])
def test_a_stalled_rank_fails_naming_rank_phase_and_operation(small_dataset, tmp_path, checks_in, phase, operation):
    overrides = overrides_for("dense", small_dataset, tmp_path, 2, **{"parallel.dp_shard": 2,
                                                                      "train.collective_timeout_s": 1})
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0 of 2 failed") as info:
        run_ranks(_rank1_stalls, 2, overrides, checks_in, timeout=HANG_S)
    assert time.monotonic() - start < 15  # the configured 1 s, not the harness's 30 s
    message = str(info.value)
    assert ("ParallelError: rank 0 of 2: a collective did not complete within train.collective_timeout_s=1 s "
            f"during {phase}") in message
    assert "operation: all_reduce in " in message and operation in message


@pytest.mark.dist
def test_an_error_on_rank_0_alone_fails_every_rank_at_once(tmp_path):
    # Rank 0 alone reads the data first (it may have to prepare it): a missing dataset must not leave
    # rank 1 waiting for it until the collective timeout.
    overrides = overrides_for("dense", str(tmp_path / "missing"), tmp_path / "run", 1, **{"parallel.dp_shard": 2})
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(train_on_ranks, 2, "dense", overrides, timeout=HANG_S)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "--- rank 0 ---" in message and "--- rank 1 ---" in message
    assert "DataError: on rank 0: " in message  # rank 1's copy of rank 0's error
