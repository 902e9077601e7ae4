"""The training loop end to end on a small real dataset: metrics, evaluation, accumulation,
bf16 master weights, MoE statistics and expert bias, initialisation from a HuggingFace directory."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tessera.config.errors import CheckpointError, DataError
from tessera.config.schema import load_config
from tessera.hf import save_pretrained
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink


def _run(config, overrides):
    trainer = Trainer(load_config(config, overrides))
    return trainer, trainer.train()


def test_metrics_and_evaluation(small_dataset, tmp_path):
    overrides = moe_shrink(small_dataset, tmp_path, 4, **{"train.eval_interval": 2, "data.valid_fraction": 0.1,
                                                          "train.eval_steps": 1, "log.tensorboard": True,
                                                          "log.peak_flops": 1e12})
    trainer, result = _run(TINY_MOE, overrides)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and result.last_step == 4
    for r in lines:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "mem_gib", "aux_loss"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), key
        assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / 1e12)
        assert {"aux/layer0/load_balancing", "aux/layer1/z_loss", "expert_load/layer1/max_over_mean"} <= set(r)
        assert r["expert_load/layer0/mean_tokens"] == 2 * 4 * 32 / 4  # k * tokens / E, summed over the step
        assert r["expert_load/layer0/max_over_mean"] >= 1.0
    assert "val_loss" in lines[1] and "val_loss" in lines[3] and "val_loss" not in lines[2]
    assert lines[3]["val_ppl"] == pytest.approx(math.exp(lines[3]["val_loss"]))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "config.yaml").is_file()
    assert trainer.evaluate()["val_loss"] == pytest.approx(lines[3]["val_loss"], rel=1e-6)


def test_mfu_is_null_on_cpu_without_a_configured_peak(small_dataset, tmp_path):
    _run(TINY_DENSE, shrink(small_dataset, tmp_path, 1))
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["mfu"] is None and record["tflops"] > 0 and "aux_loss" not in record


def test_gradient_accumulation_matches_one_big_micro_batch(small_dataset, tmp_path):
    _run(TINY_DENSE, shrink(small_dataset, tmp_path / "a", 3, **{"train.micro_batch_size": 4}))
    _run(TINY_DENSE, shrink(small_dataset, tmp_path / "b", 3, **{"train.micro_batch_size": 1}))
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)


def test_bf16_keeps_fp32_master_weights(small_dataset, tmp_path):
    trainer, _ = _run(TINY_DENSE, shrink(small_dataset, tmp_path / "bf16", 3, **{"train.dtype": "bf16"}))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    state = trainer.optimizer.state[next(trainer.model.parameters())]
    assert state["exp_avg"].dtype == torch.float32
    _run(TINY_DENSE, shrink(small_dataset, tmp_path / "fp32", 3))
    bf16 = [json.loads(x)["loss"] for x in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    fp32 = [json.loads(x)["loss"] for x in (tmp_path / "fp32" / "metrics.jsonl").read_text().splitlines()]
    assert bf16 != fp32  # really computed in bf16 ...
    assert bf16 == pytest.approx(fp32, rel=2e-2)  # ... and still the same model


def test_expert_bias_is_updated_after_each_step(small_dataset, tmp_path):
    overrides = shrink(small_dataset, tmp_path, 2, **{"model.preset": "tiny-deepseek", "model.n_layers": 2,
                                                      "model.moe.ffn_dim": 32})
    trainer, _ = _run(TINY_DENSE, overrides)
    biases = {n: b for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")}
    assert biases and all(b.abs().sum() > 0 for b in biases.values())
    rate = trainer.cfg.model.moe.bias_update_rate
    for b in biases.values():  # two sign steps of size `rate`: every entry is in {-2, ..., 2} * rate
        assert torch.allclose(b / rate, (b / rate).round()) and b.abs().max() <= 2 * rate + 1e-9


def test_init_from_huggingface_directory_or_tessera_checkpoint(small_dataset, tmp_path):
    trainer, _ = _run(TINY_DENSE, shrink(small_dataset, tmp_path / "a", 1))
    save_pretrained(trainer.model, tmp_path / "hf")
    started = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "b", 1,
                                                     **{"train.init_from": tmp_path / "hf", "train.seed": 7})))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(started.model.state_dict()[name], value), name
    with pytest.raises(CheckpointError, match=r"'tok_embeddings.weight' has shape \[4096, 64\] there but \[4096, 96\] "
                                              r"in the model; the model section differs from '.*hf/config.json' in "
                                              r"dim \(96 here, 64 there\), head_dim \(24 here, 16 there\): "
                                              r"leave those to the directory"):
        Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "c", 1,
                                               **{"train.init_from": tmp_path / "hf", "model.dim": 96})))
    # no model section: the model is the one the directory holds
    bare = [o for o in shrink(small_dataset, tmp_path / "e", 1, **{"train.init_from": tmp_path / "hf"})
            if not o.startswith("model.")]
    derived = Trainer(load_config(None, bare))
    for field in ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "max_seq_len"):
        assert getattr(derived.cfg.model, field) == getattr(trainer.cfg.model, field), field
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(derived.model.state_dict()[name], value), name
    from_ckpt = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "d", 1,
                                                       **{"train.init_from": tmp_path / "a", "train.seed": 7})))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(from_ckpt.model.state_dict()[name], value), name
    assert from_ckpt.step == 0


def test_sft_trains_on_answer_tokens_only(tmp_path):
    from tessera.data import default_tokenizer, preprocess_sft

    records = [{"prompt": f"What is {i} + {i}?", "response": f"It is {2 * i}."} for i in range(60)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess_sft([tmp_path / "chat.jsonl"], tmp_path / "sft", default_tokenizer(), show_progress=False)
    overrides = shrink(str(tmp_path / "sft"), tmp_path / "run", 2, **{"data.kind": "sft"})
    _, result = _run(TINY_DENSE, overrides)
    for r in result.records:
        assert 0 < r["loss_tokens"] < 4 * 32 and math.isfinite(r["loss"])
    with pytest.raises(DataError, match="has no loss mask"):
        _run(TINY_DENSE, shrink(tmp_path / "unused", tmp_path / "run2", 1, **{"data.kind": "sft",
             "data.datasets": f"[{{path: {_plain_dataset(tmp_path)}}}]"}))


def _plain_dataset(tmp_path):
    from tessera.data import default_tokenizer, preprocess

    (tmp_path / "plain.txt").write_text("def f(x):\n    return x\n" * 200)
    preprocess([tmp_path / "plain.txt"], tmp_path / "plain", default_tokenizer(), show_progress=False)
    return tmp_path / "plain"
