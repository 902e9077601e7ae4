"""Qwen3-Next (`qwen3_next`), beyond the parity every family has (tests/models/test_hf_parity.py,
tests/cli/test_convert_families.py): a prompt of several DeltaNet chunks gives transformers' logits,
the model's own cached generation (the eager reference: attention keys and values, DeltaNet states)
gives transformers' greedy tokens and those of recomputing every step, and a saved model loads back
with the same logits and config. Other families refuse to export a hybrid model."""

import pytest
import torch

from tessera.config import ModelError, get_preset
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.hf import load_pretrained, save_pretrained
from tessera.infer import SamplingParams
from tessera.infer.engine.reference_generation import reference_generate
from tessera.models import Transformer
from tests.infer.tiny_models import hf_greedy
from tests.models.hf_families import check_save_load_round_trip, hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next") / "hf"
    hf = random_hf_model(hf_configs()["qwen3_next"], seed=3)
    hf.save_pretrained(path)
    return hf, load_pretrained(path, dtype=torch.float32)


def test_prompt_of_several_chunks_equals_transformers(pair):
    hf, model = pair
    assert model.cfg.linear_attention.layers == [0, 1, 2] and model.cfg.rope_dim == 8
    ids = torch.randint(0, hf.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_greedy_generation_equals_transformers_and_recomputation(pair):
    hf, model = pair
    prompt = [3, 50, 7, 81, 22, 9, 64, 5, 13]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    cached = reference_generate(model, prompt, params)
    assert cached == reference_generate(model, prompt, params, use_cache=False)
    assert cached == hf_greedy(hf, prompt, 12)


def test_save_and_load_back_keeps_logits_and_config(pair, tmp_path):
    _, model = pair
    check_save_load_round_trip(model, tmp_path / "out")


def test_config_maps_both_ways_and_other_families_refuse_it():
    cfg = get_preset("tiny-qwen3-next")
    d = config_to_hf(cfg)
    assert d["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and d["partial_rotary_factor"] == 0.5
    assert config_from_hf(d) == cfg
    with pytest.raises(ModelError, match="export it as qwen3_next"):
        config_to_hf(get_preset("tiny-qwen3-next", family="qwen3_moe"))


def test_tiny_model_trains_its_deltanet_and_gates():
    model = Transformer(get_preset("tiny-qwen3-next", init_std=0.1), init_seed=0)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    model(ids).logits.square().mean().backward()
    block = model.layers["0"]
    for p in (block.attention.A_log, block.attention.conv1d.weight, model.layers["3"].attention.wq.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert model.norm.weight.abs().sum() == 0  # (1 + w) norms start at w = 0


def test_uneven_tensor_parallelism_refuses_deltanet_layers():
    from tessera.config.layout_rules import LayoutSizes, layout_problems

    cfg = get_preset("tiny-qwen3-next")
    assert any("model.linear_attention.n_key_heads=2" in p for p in layout_problems(cfg, LayoutSizes(tp=4)))
    assert layout_problems(cfg, LayoutSizes(dp_shard=2, ep=2)) == layout_problems(cfg, LayoutSizes(tp=2)) == []


def test_published_mtp_tensors_are_skipped_as_transformers_does(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    hf, model = pair
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(tmp_path, dtype=torch.float32)(ids).logits, model(ids).logits)


def test_prune_refuses_deltanet_layers(pair, tmp_path):
    from tessera.config import ConfigError
    from tessera.prune.run import prune
    from tessera.prune.selection import PruneSizes

    save_pretrained(pair[1], tmp_path / "src")
    with pytest.raises(ConfigError, match=r"prune: the qwen3_next model has recurrent layers"):
        prune(tmp_path / "src", tmp_path / "dst", PruneSizes(layers=2))
