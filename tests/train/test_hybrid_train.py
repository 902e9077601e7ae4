"""Training a hybrid model (Qwen3-Next: Gated DeltaNet layers, gated attention, routed experts; Kimi
Linear: Kimi delta attention, latent attention without RoPE, shared experts) with the training loop on
one process: the loss falls over a few steps on real text, with sequences of
several DeltaNet chunks, and the checkpoint it writes exports to a HuggingFace directory that
transformers runs with Tessera's logits."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.checkpoint.loading import load_model
from tessera.config.schema import load_config
from tessera.hf import save_pretrained
from tessera.train.trainer import Trainer
from tests.train.runs import shrink

CONFIG = """model:
  preset: tiny-qwen3-next
  vocab_size: 4096
  linear_attention: {chunk_size: 8}
train: {seed: 0, dtype: fp32, grad_clip: 1.0}
optim: {lr: 3.0e-3, weight_decay: 0.1}
data: {kind: pretrain}
"""


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_hybrid_model_trains_and_exports(preset, small_dataset, tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "cfg.yaml").write_text(CONFIG.replace("tiny-qwen3-next", preset))
    overrides = [o for o in shrink(small_dataset, tmp_path / "run", 8) if not o.startswith(("model.", "checkpoint."))]
    overrides += ["model.max_seq_len=64", "checkpoint.interval=8"]
    result = Trainer(load_config(str(tmp_path / "cfg.yaml"), overrides)).train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result.last_step == 8 and lines[-1]["loss"] < lines[0]["loss"] - 0.3
    model = load_model(tmp_path / "run").model
    assert model.cfg.linear_attention.chunk_size == 8 and model.cfg.linear_attention.layers == [0, 1, 2]
    save_pretrained(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
