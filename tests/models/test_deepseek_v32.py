"""DeepSeek-V3.2 (`deepseek_v32`), beyond the parity every family has (tests/models/test_hf_parity.py,
tests/cli/test_convert_families.py): over a prompt five times longer than index_topk the logits are
transformers' and differ from the same weights attending densely (so the indexer's choice is what
matches), greedy generation through the eager reference (its cache keeps the indexer keys) gives
transformers' tokens, a saved model loads back with the same logits and config, config.json maps both
ways, and a sparse model is refused by deepseek_v3's export."""

import pytest
import torch

from tessera.config import ModelError, get_preset
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.hf import load_pretrained
from tessera.infer import SamplingParams
from tessera.infer.engine.reference_generation import reference_generate
from tessera.models.transformer import Transformer
from tests.infer.tiny_models import hf_greedy
from tests.models.hf_families import check_save_load_round_trip, hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")
PROMPTS = [[3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8], [17, 4], [60, 61, 62, 63, 1, 2, 3]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v32") / "hf"
    hf = random_hf_model(hf_configs()["deepseek_v32"], seed=3, std=0.2)
    hf.save_pretrained(path)
    return hf, load_pretrained(path, dtype=torch.float32), path


def test_sparse_logits_equal_transformers_and_differ_from_dense(pair):
    hf, model, _ = pair
    assert model.cfg.mla.index_topk == 4 and model.cfg.family == "deepseek_v32"
    ids = torch.randint(0, hf.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=1e-4)
        dense_cfg = type(model.cfg)(**{**vars(model.cfg), "mla": {**vars(model.cfg.mla), "index_topk": 20}})
        dense = Transformer(dense_cfg)
        dense.load_state_dict(model.state_dict())
        assert (dense(ids).logits - want).abs().max() > 1e-2  # the choice of keys changes the logits


def test_greedy_generation_equals_transformers(pair):
    hf, model, _ = pair
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        want = hf_greedy(hf, prompt, 10)
        assert reference_generate(model, prompt, params) == want
        assert reference_generate(model, prompt, params, use_cache=False) == want


def test_save_and_load_back_keeps_logits_and_config(pair, tmp_path):
    _, model, _ = pair
    check_save_load_round_trip(model, tmp_path / "out")


def test_config_maps_both_ways_and_deepseek_v3_refuses_the_indexer():
    cfg = get_preset("tiny-deepseek-v32")
    d = config_to_hf(cfg)
    assert d["model_type"] == "deepseek_v32" and "rope_interleave" not in d
    assert (d["index_topk"], d["index_n_heads"], d["index_head_dim"]) == (8, 4, 16)
    assert config_from_hf(d) == cfg
    v3 = type(cfg)(**{**vars(cfg), "family": "deepseek_v3"})
    with pytest.raises(ModelError, match=r"deepseek_v3 has no sparse attention \(model.mla.index_topk=8\); export "
                                         r"it as deepseek_v32"):
        config_to_hf(v3)
    dense = type(cfg)(**{**vars(cfg), "mla": {**vars(cfg.mla), "index_topk": None}})
    with pytest.raises(ModelError, match=r"index_topk=None.*export it as deepseek_v3"):
        config_to_hf(dense)
    with pytest.raises(ModelError, match="q_lora_rank=None is not supported for deepseek_v32"):
        config_from_hf({**d, "q_lora_rank": None})
