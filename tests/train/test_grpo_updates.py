"""GRPO's train.grpo.updates_per_rollout and train.grpo.bitwise.

More than one update on a rollout moves the policy away from the one that sampled it, so its ratio
leaves the clip range (clip_fraction > 0), while a rollout sampled once per step never does; the
engine samples once per step whatever the number of updates, and the optimizer steps that many
times. In the bitwise mode the log-probabilities of the sampled tokens that the importance weights
and logprob_diff_* read are scored by the trainer's own forward, so they equal the trainer's
exactly (logprob_diff_max == 0, in one process and under tp and dp_shard), where the paged engine's,
attending in fp32, differ in the last bits.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tessera.cli import main
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.eval.rollouts import EngineRollouts
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.infer.tiny_models import write_model
from tests.parallel.trainer_runs import whole_parameters
from tests.train.runs import TINY_DENSE
from tests.train.test_grpo_train import FixedRollouts, _hand_objective, _overrides, _records, grpo_root

ROOT = Path(__file__).resolve().parents[2]
HIGH_LR = {"optim.lr": 5e-2, "train.steps": 3}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return grpo_root(tmp_path_factory)


def _train(root, run: str, monkeypatch=None, **extra) -> tuple[list[dict], dict[str, int]]:
    """Train; the records and how often the engine sampled and the optimizer stepped."""
    cfg = load_config(TINY_DENSE, _overrides(root, run, **extra))
    rollouts = EngineRollouts(cfg)
    trainer = Trainer(cfg, rollouts=rollouts)
    calls = {"rollouts": 0, "optimizer_steps": 0}
    if monkeypatch is not None:  # counts what the real parts do
        sample, step = rollouts.rollouts, trainer.optimizer.step

        def counted_rollouts(*args, **kwargs):
            calls["rollouts"] += 1
            return sample(*args, **kwargs)

        def counted_step(*args, **kwargs):
            calls["optimizer_steps"] += 1
            return step(*args, **kwargs)
        monkeypatch.setattr(rollouts, "rollouts", counted_rollouts)
        monkeypatch.setattr(trainer.optimizer, "step", counted_step)
    trainer.train()
    return _records(root / run), calls


def test_more_updates_per_rollout_move_the_ratio_out_of_the_clip_range(root, monkeypatch):
    once, calls_once = _train(root, "updates-1", monkeypatch, **HIGH_LR)
    four, calls_four = _train(root, "updates-4", monkeypatch, **{**HIGH_LR, "train.grpo.updates_per_rollout": 4})
    assert calls_once == {"rollouts": 3, "optimizer_steps": 3}
    assert calls_four == {"rollouts": 3, "optimizer_steps": 12}  # one rollout, four updates a step
    assert all(r["clip_fraction"] == 0 for r in once)  # the sampling policy is the policy: ratio 1
    assert max(r["clip_fraction"] for r in four) > 0.02, [r["clip_fraction"] for r in four]
    # the first step samples the same completions either way: the same rewards, the same engine figures
    for key in ("reward_mean", "response_length", "logprob_diff_max"):
        assert four[0][key] == once[0][key], key


def test_updates_per_rollout_below_1_is_refused_by_name(root):
    with pytest.raises(ConfigError, match=r"train.grpo.updates_per_rollout=0 is invalid: >= 1"):
        load_config(TINY_DENSE, _overrides(root, "r", **{"train.grpo.updates_per_rollout": 0}))


def test_the_bitwise_mode_scores_the_sampled_tokens_exactly_as_the_trainer(root):
    # the paged engine attending in fp32, as the bitwise mode does (float64: test_grpo_logprob_agreement.py)
    paged, _ = _train(root, "paged", **{**HIGH_LR, "train.grpo.fp64_attention": "false"})
    bitwise, _ = _train(root, "bitwise", **{**HIGH_LR, "train.grpo.bitwise": "true"})
    assert all(r["logprob_diff_max"] > 0 for r in paged)  # the paged engine's last bits differ
    assert max(r["logprob_diff_max"] for r in paged) < 1e-5
    for r in bitwise:
        assert r["logprob_diff_max"] == 0 and r["logprob_diff_mean"] == 0, r
    for mine, theirs in zip(bitwise, paged, strict=True):  # the engine samples the same tokens
        assert mine["reward_mean"] == theirs["reward_mean"] and mine["response_length"] == theirs["response_length"]


def _bitwise_on_ranks(overrides: list[str]) -> list[dict]:
    cfg = load_config(TINY_DENSE, overrides)
    return Trainer(cfg, rollouts=EngineRollouts(cfg)).train().records


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"parallel.tp": 2, "parallel.dp_shard": 1}, {"parallel.dp_shard": 2}],
                         ids=["tp2", "fsdp2"])
def test_the_bitwise_mode_is_exact_under_tp_and_dp_shard(root, layout):
    run = "bitwise-" + "-".join(f"{k.split('.')[-1]}{v}" for k, v in layout.items())
    extra = {**HIGH_LR, "train.grpo.bitwise": "true", "train.micro_batch_size": 1, **layout}
    records = run_ranks(_bitwise_on_ranks, 2, _overrides(root, run, **extra), timeout=HANG_S)[0]
    assert len(records) == 3 and any(r["grad_norm"] > 0 for r in records)
    for r in records:
        assert r["logprob_diff_max"] == 0 and r["logprob_diff_mean"] == 0, r
        assert torch.isfinite(torch.tensor(r["loss"]))


def test_the_second_update_on_a_rollout_equals_a_hand_written_reference(root):
    """updates_per_rollout=2 on fixed rollouts: the step applies the first update itself and leaves the
    second's gradient, which is that of the clipped objective at the moved policy against the
    sampling policy's log-probabilities (and its TIS weights); the logged loss and clip fraction are
    the means of the two updates'."""
    cfg = load_config(TINY_DENSE, _overrides(root, "hand-updates", **{
        "train.grpo.updates_per_rollout": 2, "optim.lr": 3e-2, "train.grpo.temperature": 0.7,
        "train.grpo.kl_coef": 0.1, "train.grpo.tis_cap": 1.5, "train.grpo.group_size": 2,
        "train.grpo.clip_low": 0.05, "train.grpo.clip_high": 0.05}))
    rollouts = FixedRollouts(2)
    trainer = Trainer(cfg, rollouts=rollouts)
    initial = copy.deepcopy(trainer.model)
    batch = trainer.data.train.next_batch()
    result = trainer.engine.forward_backward(batch)  # the first update applied, the second's gradient left
    moved = copy.deepcopy(trainer.model)
    assert any(not torch.equal(p, q) for p, q in zip(moved.parameters(), initial.parameters()))
    prompts = rollouts.seen[0]
    ro = rollouts.rollouts(prompts, [], [])
    g = cfg.train.grpo
    first, first_figures = _hand_objective(copy.deepcopy(initial), initial, prompts, ro, g, "token")
    second, figures = _hand_objective(moved, initial, prompts, ro, g, "token", old=initial)
    second.backward()
    assert first_figures["clipped"] == 0 and figures["clipped"] > 0
    assert result.loss == pytest.approx((first.item() + second.item()) / 2, rel=1e-5, abs=1e-7)
    assert result.scalars["clip_fraction"] == pytest.approx(figures["clipped"] / (2 * figures["tokens"]), abs=1e-12)
    grads = dict(moved.named_parameters())
    for name, p in trainer.model.named_parameters():
        want = grads[name].grad
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_smollm2_recipe_runs_as_written_on_a_model_of_its_shape(tmp_path, monkeypatch):
    """configs/grpo-smollm2.yaml, with its HuggingFace directory (`smollm2-hf`, relative to the working
    directory, as the guide's `tessera convert` writes it) a tiny random llama with the tokenizer:
    the config needs no other key, and two steps log the GRPO figures."""
    write_model(tmp_path / "smollm2-hf", "llama")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["train", str(ROOT / "configs" / "grpo-smollm2.yaml"), "--set", f"run_dir={run}",
                 "--set", "train.steps=2", "--set", "log.tensorboard=false", "--set", "log.progress_bar=false",
                 "--set", "train.grpo.max_new_tokens=4"]) == 0
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 <= r["reward_mean"] <= 1 and r["logprob_diff_max"] < 1e-4 for r in records)


UPDATES = {**HIGH_LR, "train.grpo.updates_per_rollout": 3, "optim.eps": 1e-3, "train.micro_batch_size": 1}


@pytest.fixture(scope="module")
def updates_one_process(root) -> dict:
    return _updates_on_ranks(_overrides(root, "updates-one", **UPDATES))


def _updates_on_ranks(overrides: list[str]) -> dict:
    cfg = load_config(TINY_DENSE, overrides)
    trainer = Trainer(cfg, rollouts=EngineRollouts(cfg))
    return {"records": trainer.train().records, "weights": whole_parameters(trainer.parts)}


@pytest.mark.dist
@pytest.mark.parametrize("layout", [
    pytest.param({"parallel.dp_shard": 2}, id="fsdp2"),
    pytest.param({"parallel.optimizer": "distributed", "parallel.bucket_mb": 0.1, "parallel.dp_replicate": 2,
                  "parallel.dp_shard": 1}, id="distributed-optimizer"),
    pytest.param({"parallel.tp": 2, "parallel.dp_shard": 1}, id="tp2"),
])
def test_updates_per_rollout_on_ranks_train_the_one_process_policy(root, updates_one_process, layout):
    """The updates the step applies itself (clipped, stepped, zeroed) under each layout's gradient
    reduction and optimizer, then the trainer's: the one-process run's figures and weights."""
    ref, extra = updates_one_process, UPDATES
    run = "updates-" + "-".join(f"{k.split('.')[-1]}{v}" for k, v in layout.items())
    got = run_ranks(_updates_on_ranks, 2, _overrides(root, run, **{**extra, **layout}), timeout=HANG_S)
    assert max(r["clip_fraction"] for r in ref["records"]) > 0
    for mine, want in zip(got[0]["records"], ref["records"], strict=True):
        for key in ("reward_mean", "response_length", "clip_fraction"):
            assert mine[key] == pytest.approx(want[key], abs=1e-9), (mine["step"], key)
        assert mine["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), mine["step"]
    for name, value in ref["weights"].items():
        torch.testing.assert_close(got[0]["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)
