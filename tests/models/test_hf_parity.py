"""Every supported family: a random HuggingFace model loads into Tessera with the same logits, and
Tessera's export loads back into transformers with the same logits (fp32, 1e-4)."""

import json

import pytest
import torch

from tessera.hf import load_pretrained, save_pretrained
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")
CASES = sorted(hf_configs())


@pytest.mark.parametrize("name", CASES)
def test_roundtrip_logits_match_transformers(name, tmp_path):
    hf = random_hf_model(hf_configs()[name])
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits

    model = load_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        out = model(ids)
    torch.testing.assert_close(out.logits, want, atol=1e-4, rtol=1e-4)
    assert out.aux_loss.dim() == 0

    save_pretrained(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    with torch.no_grad():
        again = back(ids).logits
    torch.testing.assert_close(again, want, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_roundtrip(tmp_path):
    hf = random_hf_model(hf_configs()["mixtral"])
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    model = load_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.arange(10).view(1, 10)
    back = load_pretrained(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_every_registered_family_has_a_parity_case():
    from tessera.config.families import REGISTRY

    assert {config.model_type for config in hf_configs().values()} == set(REGISTRY)
