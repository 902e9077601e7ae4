"""configs/tiny-deepseek.yaml is the DeepSeek-V3 recipe in miniature and trains on a CPU in seconds."""

from __future__ import annotations

import torch

from tessera.config.schema import load_config
from tessera.models.mla import MultiHeadLatentAttention
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DEEPSEEK


def test_tiny_deepseek_config_trains(small_dataset, tmp_path):
    overrides = [f"run_dir={tmp_path}", f"data.datasets=[{{path: {small_dataset}}}]", "train.steps=12",
                 "train.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "train.log_interval=1",
                 "train.eval_interval=0", "optim.lr=3e-3", "optim.warmup_steps=2", "checkpoint.interval=0",
                 "log.tensorboard=false", "log.progress_bar=false", "train.device=cpu"]
    cfg = load_config(TINY_DEEPSEEK, overrides)
    moe = cfg.model.moe
    assert cfg.model.mla is not None and moe.score_func == "sigmoid" and moe.expert_bias
    assert moe.shared_ffn_dim > 0 and moe.seq_aux_loss_coef > 0
    trainer = Trainer(cfg)
    assert all(isinstance(b.attention, MultiHeadLatentAttention) for b in trainer.model.layers.values())
    records = trainer.train().records
    losses = [r["loss"] for r in records]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0, losses  # it learns
    assert all(r["aux/layer1/seq_load_balancing"] > 0 for r in records)
    bias = trainer.model.layers["1"].moe.router.expert_bias
    assert bias.abs().sum() > 0  # the aux-loss-free bias moved
