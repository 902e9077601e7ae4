"""Each of Llama 4's parts matters to the parity `tests/models/test_hf_parity.py` proves for
`llama4_text`: with any one of them switched off (chunked attention, the weightless QK norm, the
NoPE layers' temperature, the experts' input gate, adjacent rotary pairs) the same weights no longer
give transformers' logits, so a part the loader or the decoder dropped could not pass unnoticed."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.hf import load_pretrained
from tessera.models import Transformer
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")


def test_every_part_changes_the_logits(tmp_path):
    hf = random_hf_model(hf_configs()["llama4_text"], std=0.2)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.float32)
    cfg = model.cfg
    assert (cfg.moe_layers, cfg.nope_layers, cfg.attention_chunk_size) == ([1, 3], [2], 5)
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(1))  # 5 chunks, temperature steps
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=1e-4)
    moe = cfg.to_dict()["moe"]
    for change in (dict(attention_chunk_size=None), dict(qk_l2_norm=False), dict(nope_attn_scale=0.0),
                   dict(moe={**moe, "gate_input": False}), dict(rope_interleave=False)):
        other = Transformer(ModelConfig(**{**cfg.to_dict(), **change}), init_seed=None)
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert not torch.allclose(other(ids).logits, want, atol=1e-3), change
