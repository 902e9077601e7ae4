"""Qwen3.5, text (`qwen3_5_text`), beyond the parity every family has (tests/models/test_hf_parity.py,
tests/cli/test_convert_families.py): a prompt of several DeltaNet chunks gives transformers' logits,
greedy generation through the eager reference and through the serving engine (recurrent-state slots,
chunked prefill, requests batched together) gives transformers' tokens, a saved model loads back
with the same logits and config, and Qwen3-Next's projection layout is refused on export (its
layouts: tests/parallel/test_hybrid_layouts.py)."""

import pytest
import torch

from tessera.config import ModelError, get_preset
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.hf import load_pretrained
from tests.models.hf_families import (
    check_greedy_eager_and_served,
    check_save_load_round_trip,
    hf_configs,
    random_hf_model,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5") / "hf"
    hf = random_hf_model(hf_configs()["qwen3_5_text"], seed=3, std=0.2)
    hf.save_pretrained(path)
    return hf, load_pretrained(path, dtype=torch.float32), path


def test_prompt_of_several_chunks_equals_transformers(pair):
    hf, model, _ = pair
    la = model.cfg.linear_attention
    assert la.layers == [0, 1, 2] and la.projections == "split" and model.cfg.moe is None
    ids = torch.randint(0, hf.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_greedy_generation_equals_transformers_eager_and_served(pair):
    check_greedy_eager_and_served(*pair)


def test_save_and_load_back_keeps_logits_and_config(pair, tmp_path):
    _, model, _ = pair
    check_save_load_round_trip(model, tmp_path / "out")


def test_config_maps_both_ways_and_the_other_layout_is_refused():
    cfg = get_preset("tiny-qwen3.5")
    d = config_to_hf(cfg)
    assert d["model_type"] == "qwen3_5_text" and d["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config_from_hf(d) == cfg
    grouped = get_preset("tiny-qwen3.5", linear_attention={**vars(cfg.linear_attention), "projections": "grouped"})
    with pytest.raises(ModelError, match=r"projections=grouped\); export it as qwen3_next"):
        config_to_hf(grouped)

