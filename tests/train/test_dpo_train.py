"""`tessera train` with `train.objective=dpo` (tessera/train/modes/dpo.py) on preference pairs
(data.kind=preference): every logged step has the DPO metrics and the reward margin rises; the
reference is the run's initial weights, frozen, also after a resume, which continues as the straight
run; data-parallel layouts (FSDP, replicas with an MoE policy, the distributed optimizer) train the
one-process policy; what DPO does not support is refused by name before anything is built, and a
bad record in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tessera.cli import main
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.train.modes.registry import training_mode
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process
from tests.train.runs import TINY_DENSE, set_args, shrink

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")
WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "table", "light"]


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> str:
    """Sixteen pairs, text and chat: the chosen answer is the sum, the rejected one a word."""
    records = []
    for i in range(16):
        prompt = f"What is {i} plus {i + 3}?"
        if i % 2:
            records.append({"prompt": prompt, "chosen": str(2 * i + 3), "rejected": WORDS[i % 8]})
        else:
            records.append({"prompt": [{"role": "user", "content": prompt}],
                            "chosen": [{"role": "assistant", "content": str(2 * i + 3)}],
                            "rejected": [{"role": "assistant", "content": WORDS[i % 8]}]})
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


DPO = {"data.kind": "preference", "train.objective": "dpo", "train.seq_len": 48, "optim.lr": 2e-3,
       "optim.warmup_steps": 0}


def _dpo(prefs: str, run: Path, steps: int, **extra) -> list[str]:
    return shrink(prefs, run, steps, **{**DPO, **extra})


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tessera_train_logs_the_dpo_metrics_every_logged_step_and_the_margin_rises(prefs, tmp_path, capsys):
    run = tmp_path / "dpo"
    assert main(["train", TINY_DENSE, *set_args(_dpo(prefs, run, 12, **{"train.log_interval": 2}))]) == 0
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2, 4, 6, 8, 10, 12]
    for r in records:
        assert all(isinstance(r[k], float) and math.isfinite(r[k]) for k in KEYS), r
        assert r["rewards/margin"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-12)
        assert 0 <= r["rewards/accuracy"] <= 1 and r["loss_tokens"] > 0
    # step 1: the policy is its reference, so every reward is 0 and the loss is log 2
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-7) and records[0]["rewards/margin"] == 0
    margins = [r["rewards/margin"] for r in records]
    assert margins[-1] > 0.2 and sum(margins[-3:]) > sum(margins[:3]) + 0.5, margins
    assert records[-1]["rewards/accuracy"] >= 0.75 and records[-1]["loss"] < 0.6
    err = capsys.readouterr().err
    assert "objective: DPO, sigmoid loss, beta 0.1, against a frozen reference: the initial weights" in err
    assert "batch: 4 pairs of sequences x 48 tokens" in err


def _train(overrides: list[str], resume: bool = False) -> dict:
    from tessera.train.trainer import Trainer

    trainer = Trainer(load_config(TINY_DENSE, overrides), resume=resume)
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    result = trainer.train()
    return {"records": result.records, "start_step": result.start_step, "initial": initial,
            "policy": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "reference": {k: v.clone() for k, v in trainer.engine.reference.state_dict().items()},
            "frozen": all(not p.requires_grad for p in trainer.engine.reference.parameters())}


def test_the_reference_is_the_frozen_initial_weights_and_a_resumed_run_continues_as_the_straight_one(prefs, tmp_path):
    full = _train(_dpo(prefs, tmp_path / "full", 4))
    assert full["frozen"]
    for name, value in full["initial"].items():  # the reference is where the policy started, and stays there
        assert torch.equal(full["reference"][name], value), name
    assert any(not torch.equal(full["policy"][k], v) for k, v in full["initial"].items())
    _train(_dpo(prefs, tmp_path / "split", 2))
    second = _train(_dpo(prefs, tmp_path / "split", 4), resume=True)
    assert second["start_step"] == 2
    for name, value in full["initial"].items():  # rebuilt from the seed, not read from the checkpoint
        assert torch.equal(second["reference"][name], value), name
    got, want = {r["step"]: r for r in _records(tmp_path / "split")}, {r["step"]: r for r in full["records"]}
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in (*KEYS, "grad_norm", "logps/chosen"):
            assert got[step][key] == want[step][key], (step, key)
    for name, value in full["policy"].items():
        assert torch.equal(second["policy"][name], value), name


LAYOUTS = [
    pytest.param("dense", 2, {"parallel.dp_shard": 2}, id="dense-fsdp2"),
    pytest.param("moe", 2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, id="moe-replicate2"),
    pytest.param("dense", 2, {"parallel.optimizer": "distributed", "parallel.bucket_mb": 0.1,
                              "parallel.dp_replicate": 2, "parallel.dp_shard": 1}, id="dense-distributed-optimizer"),
    # tensor parallelism: the log-probabilities from the vocabulary-sharded logits, never gathered
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="dense-tp2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, id="dense-tp2-sp"),
    pytest.param("dense", 4, {"parallel.tp": 2, "parallel.dp_shard": 2}, id="dense-tp2-fsdp2",
                 marks=pytest.mark.slow),
]


@pytest.mark.dist
@pytest.mark.parametrize("model,world,layout", LAYOUTS)
def test_data_and_tensor_parallel_ranks_train_the_one_process_policy(prefs, tmp_path, model, world, layout):
    extra = {**DPO, "train.micro_batch_size": 1}  # two micro-batches per rank: accumulation before the reduction
    ref = train_one_process(model, overrides_for(model, prefs, tmp_path / "one", 3, **extra))
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, prefs, tmp_path / "two", 3, **extra, **layout), timeout=HANG_S)
    assert_same_training(got, ref, rtol=1e-5)
    for r, w in zip(got[0]["records"], ref["records"], strict=True):
        # a reward is beta x a difference of two log-probabilities: within 1e-5 of their scale
        scale = 0.1 * max(abs(w["logps/chosen"]), abs(w["logps/rejected"]))
        for key in (*KEYS[1:], "logps/chosen", "logps/rejected"):
            assert abs(r[key] - w[key]) <= 1e-5 * max(abs(w[key]), scale), (key, r[key], w[key])
    assert ref["records"][-1]["rewards/margin"] > 0
    if model == "moe":
        assert ref["records"][-1]["aux_loss"] > 0


@pytest.mark.parametrize("extra,message", [
    ({"train.objective": "ppo"}, r"train.objective='ppo' is invalid: one of lm, dpo, grpo"),
    ({"data.kind": "sft"}, r"data.kind='sft' is invalid: preference with train.objective=dpo"),
    ({"train.objective": "lm"}, r"data.kind='preference' is invalid: pretrain, sft or vision_sft with "
                                r"train.objective=lm"),
    ({"train.dpo.beta": 0}, r"train.dpo.beta=0.0 is invalid: a finite number > 0"),
    ({"train.dpo.loss": "hinge"}, r"train.dpo.loss='hinge' is invalid: one of sigmoid, ipo"),
    ({"parallel.cp": 2}, r"parallel.cp=2 is invalid: 1 with train.objective=dpo \(DPO runs in one process and "
                        r"under dp_replicate / dp_shard / tp only\)"),
    ({"parallel.pp": 2}, r"parallel.pp=2 is invalid: 1 with train.objective=dpo"),
    ({"train.dtype": "fp16"}, r"train.dtype='fp16' is invalid: fp32 or bf16 with train.objective=dpo"),
    ({"train.eval_interval": 5}, r"train.eval_interval=5 is invalid: 0 with train.objective=dpo"),
    ({"model.mtp_depth": 1}, r"model.mtp_depth=1 is invalid: 0 with train.objective=dpo"),
    ({"train.distill.teacher": "runs/t"}, r"train.distill.teacher='runs/t' is invalid: null with train.objective=dpo"),
    ({"train.eagle.target": "runs/t"}, r"train.eagle.target='runs/t' is invalid: null with train.objective=dpo"),
])
def test_what_dpo_does_not_support_is_refused_by_name(prefs, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_DENSE, _dpo(prefs, tmp_path / "r", 2, **extra))


def test_the_config_chooses_the_dpo_mode(prefs, tmp_path):
    cfg = load_config(TINY_DENSE, _dpo(prefs, tmp_path / "r", 2))
    assert training_mode(cfg).name == "dpo" and cfg.train.dpo.beta == 0.1 and cfg.train.dpo.loss == "sigmoid"
    assert training_mode(load_config(TINY_DENSE, ["train.device=cpu"])).name == "lm"


def test_a_bad_record_stops_the_run_in_one_line_before_the_first_step(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Q", "chosen": "yes"}) + "\n")
    assert main(["train", TINY_DENSE, *set_args(_dpo(str(bad), tmp_path / "run", 2))]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (f"tessera train: error: {bad}:1: a preference record needs 'prompt', 'chosen' and "
                         "'rejected'; missing 'rejected' (fields present: chosen, prompt)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
