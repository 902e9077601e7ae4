"""A run that meets a bad step goes on correctly and says so: a gradient that is not finite on any
rank is skipped on every rank (train.skip_nonfinite; false stops the run), a loss spike rolls the run
back to its last checkpoint and skips the batches since (train.spike_factor), a rank that is slower
than the others is named (log.straggler_threshold); each is an event in run_dir/events.jsonl."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
import torch.distributed as dist

from tessera.config.errors import TrainingError
from tessera.config.schema import load_config
from tessera.parallel.jobs.events import read_events
from tessera.train.run.loss_spike import MAX_ROLLBACKS, LossSpikeRule
from tessera.train.run.metrics_writer import read_metrics
from tessera.train.run.rank_timing import slowest_rank
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.parallel.trainer_runs import whole_parameters
from tests.train.runs import TINY_DENSE, shrink

FSDP2 = {"parallel.dp_shard": 2, "optim.eps": 1e-3}
DIVERGE = {"optim.lr": "1e5", "optim.min_lr": 0, "optim.warmup_steps": 0, "train.grad_clip": 0}  # NaN at step 4


def _adam_steps(trainer: Trainer) -> set[int]:
    return {int(s["step"]) for s in trainer.optimizer.state.values()}


def _nan_gradient_on_rank_1_at_step_2(dataset: str, run_dir: str) -> dict:
    """On each rank: 3 steps of FSDP2, rank 1's local gradient shard poisoned with one NaN at step 2."""
    trainer = Trainer(load_config(TINY_DENSE, shrink(dataset, run_dir, 3, **FSDP2)))
    forward_backward, weights = trainer.engine.forward_backward, {}

    def poisoned(batch):
        if trainer.step in (2, 3):
            weights[trainer.step] = whole_parameters(trainer.parts)  # before the step's update
        stats = forward_backward(batch)
        if trainer.step == 2 and dist.get_rank() == 1:
            grad = next(p.grad for p in trainer.model.parameters() if p.grad is not None)
            grad.to_local().view(-1)[0] = float("nan")
        return stats

    trainer.engine.forward_backward = poisoned
    result = trainer.train()
    return {"skipped": [r.get("skipped_step", False) for r in result.records], "adam_steps": _adam_steps(trainer),
            "unchanged": all(torch.equal(weights[2][k], weights[3][k]) for k in weights[2])}


@pytest.mark.dist
def test_a_nonfinite_gradient_on_one_rank_is_skipped_on_every_rank(small_dataset, tmp_path):
    results = run_ranks(_nan_gradient_on_rank_1_at_step_2, 2, small_dataset, str(tmp_path), timeout=HANG_S)
    assert results[0]["skipped"] == [False, True, False]  # rank 0 writes the records
    for r in results:  # neither the weights nor Adam's state moved on either rank
        assert r["unchanged"] and r["adam_steps"] == {2}, r
    assert [(e["step"], e["grad_norm"]) for e in read_events(tmp_path, "nonfinite_step")] == [(2, "nan")]


def test_skip_nonfinite_false_stops_the_run_at_that_step(small_dataset, tmp_path):
    """lr=1e5 drives the weights towards inf within a few steps, where gradients become NaN."""
    skipping = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "skip", 5, **DIVERGE))).train()
    skipped = [r["step"] for r in skipping.records if r.get("skipped_step")]
    assert skipped and skipped[0] > 1
    assert [e["step"] for e in read_events(tmp_path / "skip", "nonfinite_step")] == skipped

    stopping = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "stop", 5, **DIVERGE,
                                                      **{"train.skip_nonfinite": False})))
    with pytest.raises(TrainingError, match=rf"step {skipped[0]}: the gradient is not finite .*"
                                            r"train.skip_nonfinite=false"):
        stopping.train()
    assert [r["step"] for r in read_metrics(tmp_path / "stop")] == list(range(1, skipped[0]))
    assert read_events(tmp_path / "stop") == []


def _spiking(trainer: Trainer, at: set[int], times: int = 1) -> list[torch.Tensor]:
    """Make the spike rule see loss x 100 the first `times` times step `at` is trained (the loss the
    engine computed, scaled: the rule only reads the number); returns the batches drawn, in order."""
    forward_backward, next_batch, drawn, seen = trainer.engine.forward_backward, trainer.data.train.next_batch, [], {}

    def spiked(batch):
        stats = forward_backward(batch)
        seen[trainer.step] = seen.get(trainer.step, 0) + 1
        if trainer.step in at and seen[trainer.step] <= times:
            stats.loss *= 100
        return stats

    def recorded():
        batch = next_batch()
        drawn.append(batch.inputs.clone())
        return batch

    trainer.engine.forward_backward, trainer.data.train.next_batch = spiked, recorded
    return drawn


SPIKE_RULE = {"train.spike_factor": 3, "train.spike_window": 3, "checkpoint.interval": 2, "checkpoint.keep_last": 4}


def test_a_loss_spike_rolls_back_to_the_last_checkpoint_and_skips_its_batches(small_dataset, tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, run, 8, **SPIKE_RULE)))
    drawn = _spiking(trainer, {5})
    result = trainer.train()
    spikes = read_events(run, "loss_spike")
    assert [(e["step"], e["rolled_back_to"], e["skipped_batches"]) for e in spikes] == [(5, 4, 1)]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))  # each step once
    assert len(drawn) == 9  # 8 steps and the one batch skipped

    # The same as resuming from step 4 with the spike's batch thrown away.
    reference = tmp_path / "reference"
    (reference / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step_00000004", reference / "checkpoints" / "step_00000004")
    (reference / "checkpoints" / "latest").write_text("step_00000004\n")
    resumed = Trainer(load_config(TINY_DENSE, shrink(small_dataset, reference, 8, **SPIKE_RULE)), resume=True)
    resumed.data.train.next_batch()
    expected = resumed.train()
    assert [r["loss"] for r in result.records if r["step"] > 4] == [r["loss"] for r in expected.records]
    got, want = whole_parameters(trainer.parts), whole_parameters(resumed.parts)
    assert all(torch.equal(got[k], want[k]) for k in want)
    state = json.loads(torch.load(_dcp(run, tmp_path), weights_only=False)["trainer"])
    assert [step for step, _ in state["spike_rule"]["history"]] == [6, 7, 8]  # the rule resumes as it was


def _dcp(run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / "step_00000008", tmp_path / "final.pt")
    return tmp_path / "final.pt"


def test_spikes_that_other_batches_do_not_cure_stop_the_run(small_dataset, tmp_path):
    trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path, 8, **SPIKE_RULE)))
    _spiking(trainer, {5}, times=MAX_ROLLBACKS + 1)
    with pytest.raises(TrainingError, match=f"step 5: .* after {MAX_ROLLBACKS} roll-backs to step_00000004"):
        trainer.train()
    assert len(read_events(tmp_path, "loss_spike")) == MAX_ROLLBACKS


def test_a_spike_before_any_checkpoint_skips_its_update(small_dataset, tmp_path):
    trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path, 5, **{**SPIKE_RULE,
                                                                                   "checkpoint.interval": 0})))
    _spiking(trainer, {4})
    result = trainer.train()
    assert [r.get("skipped_step", False) for r in result.records] == [False, False, False, True, False]
    assert [(e["step"], e["rolled_back_to"]) for e in read_events(tmp_path, "loss_spike")] == [(4, None)]


def test_the_spike_rule_compares_with_the_median_of_the_window():
    rule = LossSpikeRule(factor=2.0, window=3)
    assert [rule.check(s, v) for s, v in [(1, 9.0), (2, 1.0), (3, 1.2)]] == [None, None, None]  # filling
    spike = rule.check(4, 2.5)  # median of 9, 1, 1.2 is 1.2: 2.5 > 2.4
    assert spike is not None and spike.median == 1.2 and spike.step == 4
    assert rule.check(4, 2.3) is None  # not a spike: it joins the window (now 1, 1.2, 2.3)
    assert rule.check(5, float("nan")) is None and rule.state_dict()["history"] == [[2, 1.0], [3, 1.2], [4, 2.3]]


def _slow_reader_on_rank_1(dataset: str, run_dir: str, delay: float) -> list[dict]:
    trainer = Trainer(load_config(TINY_DENSE, shrink(dataset, run_dir, 4, **FSDP2,
                                                     **{"log.straggler_threshold": 0.05})))
    if dist.get_rank() == 1:
        next_batch = trainer.data.train.next_batch

        def slow():
            time.sleep(delay)
            return next_batch()

        trainer.data.train.next_batch = slow
    return trainer.train().records


@pytest.mark.dist
def test_a_rank_that_reads_its_batches_slowly_is_named(small_dataset, tmp_path):
    """Rank 1 takes a second longer for each batch: rank 0 waits for it at the step's check-in, so rank 1
    has the most work of its own and is named, from the second step on (the first is warm-up)."""
    records = run_ranks(_slow_reader_on_rank_1, 2, small_dataset, str(tmp_path), 1.0, timeout=HANG_S)[0]
    assert all(len(r["rank_step_s"]) == len(r["rank_wait_s"]) == 2 for r in records)
    assert "straggler_rank" not in records[0]
    for r in records[1:]:
        assert r["straggler_rank"] == 1 and r["straggler_lag_s"] > 0, r
        assert r["rank_wait_s"][0] > r["rank_wait_s"][1], r
    named = read_events(tmp_path, "straggler")
    assert [(e["step"], e["rank"]) for e in named] == [(2, 1)]  # once, when it began to lag


def test_the_slowest_rank_is_the_one_with_the_most_work_of_its_own():
    # Equal steps (the ranks wait for each other); rank 2 waits least, so it works most: own work
    # 0.5, 0.55, 1.0, 0.5, whose median is 0.525.
    assert slowest_rank([1.0, 1.0, 1.0, 1.0], [0.5, 0.45, 0.0, 0.5], 0.1) == (2, pytest.approx(0.475))
    assert slowest_rank([1.0, 1.0, 1.0, 1.0], [0.05, 0.0, 0.05, 0.05], 0.1) is None  # within the threshold
