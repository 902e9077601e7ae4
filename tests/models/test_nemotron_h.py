"""Nemotron-H (`nemotron_h`), beyond the parity every family has (tests/models/test_hf_parity.py,
tests/cli/test_convert_families.py): a prompt of many Mamba-2 chunks gives transformers' logits, greedy
generation through the eager reference gives transformers' tokens, a saved model loads back with the
same logits and config, config.json maps both ways (the older pattern string too), and what Tessera
does not build or export is refused by name. The MoE variants (`moe` sublayers: relu^2 experts routed by
grouped sigmoid scores with a selection bias, a relu^2 shared expert) give transformers' logits over
several Mamba chunks and its greedy tokens, eager and served; their parameters are counted as built, and
pipeline parallelism, not built for them yet, is refused by name (their layouts:
tests/parallel/test_hybrid_layouts.py)."""

import pytest
import torch

from tessera.config import ModelError, get_preset
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.hf import load_pretrained
from tessera.infer import SamplingParams
from tessera.infer.engine.reference_generation import reference_generate
from tests.infer.tiny_models import hf_greedy
from tests.models.hf_families import (
    check_greedy_eager_and_served,
    check_save_load_round_trip,
    hf_configs,
    random_hf_model,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h") / "hf"
    hf = random_hf_model(hf_configs()["nemotron_h"], seed=3, std=0.2)
    hf.save_pretrained(path)
    return hf, load_pretrained(path, dtype=torch.float32), path


def test_prompt_of_many_chunks_equals_transformers(pair):
    hf, model, _ = pair
    assert model.cfg.sublayers == ["mamba", "mlp", "attention", "mamba", "mlp"] and model.cfg.nope_layers == [2]
    ids = torch.randint(0, hf.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_greedy_generation_equals_transformers(pair):
    hf, model, _ = pair
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt in ([3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8], [17]):
        assert reference_generate(model, prompt, params) == hf_greedy(hf, prompt, 10)


def test_save_and_load_back_keeps_logits_and_config(pair, tmp_path):
    _, model, _ = pair
    check_save_load_round_trip(model, tmp_path / "out")


def test_config_maps_both_ways_and_the_pattern_string_reads_the_same():
    for name in ("tiny-nemotron-h", "nemotron-h-8b"):
        cfg = get_preset(name)
        d = config_to_hf(cfg)
        assert d["model_type"] == "nemotron_h" and len(d["layers_block_type"]) == cfg.n_layers
        assert config_from_hf(d) == cfg
        legacy = {k: v for k, v in d.items() if k != "layers_block_type"}
        legacy.update(mamba_n_groups=legacy.pop("n_groups"), mamba_d_conv=legacy.pop("conv_kernel"))
        assert config_from_hf(legacy) == cfg
    big = get_preset("nemotron-h-8b")
    assert [big.sublayers.count(k) for k in ("mamba", "attention", "mlp")] == [24, 4, 24]


def test_what_tessera_does_not_build_or_export_is_refused():
    d = config_to_hf(get_preset("tiny-nemotron-h"))
    with pytest.raises(ModelError, match=r"moe_latent_size=8 is not supported for nemotron_h; supported: None"):
        config_from_hf({**d, "layers_block_type": ["linear_attention", "moe"], "moe_latent_size": 8})
    with pytest.raises(ModelError, match=r"mlp_hidden_act='silu' is not supported for nemotron_h; supported: 'relu2'"):
        config_from_hf({**d, "mlp_hidden_act": "silu"})
    as_llama = get_preset("tiny-nemotron-h", family="llama")
    with pytest.raises(ModelError, match="export it as nemotron_h"):
        config_to_hf(as_llama)
    with pytest.raises(ModelError, match="nope_layers = its attention layers"):
        config_to_hf(get_preset("tiny-nemotron-h", nope_layers=[]))


def test_parameter_count_is_the_built_models():
    from tessera.models import Transformer
    from tessera.models.counting import count_params

    for cfg in (get_preset("tiny-nemotron-h"), get_preset("tiny-nemotron-h", mamba={
            **vars(get_preset("tiny-nemotron-h").mamba), "proj_bias": True, "conv_bias": False})):
        assert count_params(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())


def test_forward_flops_count_each_layers_one_sublayer():
    """Per token: the Mamba layers' projections and chunked SSD core (its products against the real layer's:
    tests/plan/test_hybrid_plan.py), the attention layer's projections and core, the MLPs' two matrices, each
    once (not a mixer and an MLP per layer), and the head."""
    from tessera.models.flops import forward_flops_per_token, ssd_flops_per_token

    cfg = get_preset("tiny-nemotron-h")  # mamba, mlp, attention, mlp, mamba, mlp
    m, h, s = cfg.mamba, cfg.dim, 64
    inner = m.n_heads * m.head_dim
    mamba = 2 * h * (2 * inner + 2 * m.n_groups * m.state_size + m.n_heads + inner) + ssd_flops_per_token(cfg, s)
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attention = 2 * h * (2 * q + 2 * kv) + 2 * cfg.n_heads * 2 * cfg.head_dim * s / 2
    mlp = 2 * 2 * h * cfg.ffn_dim
    assert forward_flops_per_token(cfg, s) == 2 * mamba + attention + 3 * mlp + 2 * cfg.vocab_size * h


def test_the_layouts_take_it_and_tp_must_split_whole_groups():
    """cp (the Mamba-2 state handed on from rank to rank), tp + sp are taken; tp past the groups refused."""
    from tessera.config.layout_rules import LayoutSizes, layout_problems

    cfg = get_preset("nemotron-h-8b")
    assert layout_problems(cfg, LayoutSizes(cp=2, dp_shard=1), seq_len=64) == []
    assert layout_problems(cfg, LayoutSizes(tp=2, sp=True), seq_len=64) == []
    assert any("model.mamba.n_groups" in p for p in layout_problems(cfg, LayoutSizes(tp=16), seq_len=64))


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h_moe") / "hf"
    hf = random_hf_model(hf_configs()["nemotron_h_moe"], seed=3, std=0.2)
    hf.save_pretrained(path)
    return hf, load_pretrained(path, dtype=torch.float32), path


def test_moe_variant_equals_transformers_eager_and_served(moe_pair, tmp_path):
    hf, model, path = moe_pair
    cfg = model.cfg
    assert cfg.sublayers == ["mamba", "moe", "attention", "mamba", "moe"] and cfg.moe_layers == [1, 4]
    e = cfg.moe
    assert (e.expert_activation, e.score_func, e.expert_bias, e.n_groups, e.topk_groups, e.scaling_factor,
            e.shared_ffn_dim) == ("relu2", "sigmoid", True, 2, 1, 2.5, 24)
    ids = torch.randint(0, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
    check_greedy_eager_and_served(hf, model, path)
    check_save_load_round_trip(model, tmp_path / "out")
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_moe_variant_parameters_are_counted_as_built_and_pipelines_refused(moe_pair):
    from tessera.config.layout_rules import LayoutSizes, layout_problems
    from tessera.models import Transformer
    from tessera.models.counting import count_params

    cfg = moe_pair[1].cfg
    assert count_params(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())
    e, h = cfg.moe, cfg.dim
    active = count_params(cfg) - 2 * (e.num_experts - e.top_k) * 2 * h * e.ffn_dim  # two MoE layers
    assert count_params(cfg, active=True) == active
    problems = layout_problems(cfg, LayoutSizes(pp=2, dp_shard=1), seq_len=64)
    assert any(p.startswith("pp=2 is not supported for the moe sublayers of model.sublayers") for p in problems)
    for sizes in (LayoutSizes(dp_shard=2), LayoutSizes(tp=2, sp=True, dp_shard=1), LayoutSizes(ep=2, dp_shard=2)):
        assert [p for p in layout_problems(cfg, sizes, seq_len=64) if "moe sublayers" in p] == []


def test_cp_parts_shorter_than_the_convolution_window_are_refused_by_name():
    """A cp part hands on its last W-1 convolution inputs: a part of fewer tokens (16 tokens cut into
    2 x cp=4 zig-zag parts of 2, the window 4) is refused naming the sizes and what would do."""
    from tessera.config.layout_rules import LayoutSizes, layout_problems

    cfg = get_preset("nemotron-h-8b")
    [problem] = layout_problems(cfg, LayoutSizes(cp=4, dp_shard=1, cp_method="ring"), seq_len=16)
    assert problem == ("cp=4 (ring) cuts each sequence into 8 parts of 2 tokens, fewer than the 3 earlier inputs of "
                       "the short convolution (model.mamba.conv_width=4) that a part hands on; choose train.seq_len "
                       ">= 24 or a smaller cp")
    assert layout_problems(cfg, LayoutSizes(cp=4, dp_shard=1), seq_len=16) == []  # contiguous: parts of 4
