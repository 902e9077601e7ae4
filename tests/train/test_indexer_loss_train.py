"""train.indexer_loss through the training loop on one process (tessera/config/training/indexer_loss.py): a
few steps of the dense warm-up lower every sparse-attention layer's indexer KL while every other weight
stays as initialised; a few steps of the sparse stage lower the KL and the language-model loss together;
what the loss cannot train with is refused by name. On two ranks the real Trainer with the loss (pipeline
stages, fsdp in the warm-up, cp) logs one process's losses, auxiliary losses and KL and ends with its weights."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.checkpoint.loading import load_model
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.models.transformer import Transformer
from tessera.train.trainer import Trainer
from tests.train.runs import shrink

CONFIG = """model:
  preset: tiny-deepseek-v32
  vocab_size: 4096
  init_std: 0.1
train: {seed: 0, dtype: fp32, grad_clip: 1.0}
optim: {lr: 1.0e-2, weight_decay: 0.0, warmup_steps: 1}
data: {kind: pretrain}
"""


def _run(tmp_path, dataset, steps: int, *extra: str):
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    overrides = [o for o in shrink(dataset, tmp_path / "run", steps)
                 if not o.startswith(("model.", "checkpoint.", "optim.warmup"))]
    cfg = load_config(str(tmp_path / "cfg.yaml"), [*overrides, f"checkpoint.interval={steps}", *extra])
    Trainer(cfg).train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kl = [sum(v for k, v in line.items() if k.endswith("/indexer_kl")) for line in lines]
    return cfg, lines, kl


def test_the_dense_warm_up_lowers_the_kl_and_trains_nothing_else(small_dataset, tmp_path):
    cfg, lines, kl = _run(tmp_path, small_dataset, 6, "train.indexer_loss.weight=1",
                          "train.indexer_loss.stage=dense", "model.moe.bias_update_rate=0")
    assert sorted(k for k in lines[0] if k.endswith("/indexer_kl")) == [f"aux/layer{i}/indexer_kl" for i in range(3)]
    assert kl[0] > 0 and kl[-1] < 0.7 * kl[0], kl
    initial = Transformer(cfg.model, init_seed=0).state_dict()
    trained = load_model(tmp_path / "run").model.state_dict()
    moved = sorted(k for k, v in trained.items() if not torch.equal(v, initial[k]))
    assert moved and all(".attention.indexer." in k for k in moved), moved


def test_the_sparse_stage_lowers_the_kl_and_the_language_model_loss(small_dataset, tmp_path):
    _, lines, kl = _run(tmp_path, small_dataset, 6, "train.indexer_loss.weight=1")
    assert kl[0] > 0 and kl[-1] < 0.8 * kl[0], kl
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.3


@pytest.mark.parametrize(("extra", "match"), [
    (["train.indexer_loss.weight=1", "model.preset=tiny-deepseek"],
     r"train.indexer_loss.weight=1.0 is invalid: 0 for model.family=deepseek_v3: .*lightning indexer"),
    (["train.indexer_loss.stage=warm"], r"train.indexer_loss.stage='warm' is invalid: one of dense, sparse"),
    (["train.indexer_loss.weight=-1"], r"train.indexer_loss.weight=-1.0 is invalid: a finite number >= 0"),
    (["train.indexer_loss.weight=1", "train.lora.rank=4"], r"train.lora.rank=4 is invalid: null with"),
    (["train.indexer_loss.weight=1", "train.indexer_loss.stage=dense"],
     r"model.moe.bias_update_rate=0.001 is invalid: 0 with train.indexer_loss.stage=dense"),
])
def test_what_the_loss_cannot_train_with_is_refused_by_name(tmp_path, extra, match):
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    with pytest.raises(ConfigError, match=match):
        load_config(str(tmp_path / "cfg.yaml"), ["train.device=cpu", *extra])


def _train(config: str, overrides: list[str]) -> dict:
    from tests.parallel.trainer_runs import whole_parameters

    trainer = Trainer(load_config(config, overrides))
    return {"records": trainer.train().records, "weights": whole_parameters(trainer.parts)}


@pytest.mark.dist
@pytest.mark.parametrize(("parallel", "stage"), [
    ({"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "1f1b"}, "sparse"),
    ({"parallel.dp_shard": 2}, "dense"),
    ({"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_method": "ring"}, "sparse")],
    ids=["pp2-1f1b", "fsdp2-warm-up", "cp2-ring"])
def test_the_trainer_on_two_ranks_trains_like_one_process(parallel, stage, small_dataset, tmp_path):
    from tests.forked_ranks import run_ranks
    from tests.parallel.trainer_runs import EQUALITY_OVERRIDES, assert_same_training

    (tmp_path / "cfg.yaml").write_text(CONFIG)
    extra = {"train.indexer_loss.weight": 1, "train.indexer_loss.stage": stage, "model.moe.bias_update_rate": 0}

    def overrides(run_dir, **layout):
        base = shrink(small_dataset, run_dir, 3, **{**EQUALITY_OVERRIDES, **layout})
        return [o for o in base if not o.startswith(("model.", "optim.warmup"))] + [
            f"{k}={v}" for k, v in extra.items()]

    ref = _train(str(tmp_path / "cfg.yaml"), overrides(tmp_path / "one"))
    got = run_ranks(_train, 2, str(tmp_path / "cfg.yaml"), overrides(tmp_path / "ranks", **parallel), timeout=300)
    assert_same_training(got, ref, rtol=1e-5)
    for r, w in zip(got[0]["records"], ref["records"], strict=True):
        kl = [k for k in w if k.endswith("/indexer_kl")]
        assert len(kl) == 3 and all(abs(r[k] - w[k]) <= 1e-5 * abs(w[k]) for k in kl), (r, w)
