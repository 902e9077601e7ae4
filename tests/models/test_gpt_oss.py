"""gpt-oss (gpt_oss) beyond the shared family tests: its presets' published sizes, the planner's
count against the real modules (sinks, router and expert biases), attention sinks against the
softmax with an extra column written out, and what an export refuses by name."""

from dataclasses import replace

import pytest
import torch

from tessera.config import ModelError, get_preset
from tessera.config.hf_config import config_from_hf, config_to_hf
from tessera.models import Transformer
from tessera.models.attention import causal_attention
from tessera.models.counting import count_params


def test_published_parameter_counts_and_the_modules_count():
    # gpt-oss-20b: 20.9B total, 3.6B active without embeddings; gpt-oss-120b: 116.8B (the model card)
    assert round(count_params(get_preset("gpt-oss-20b")) / 1e9, 1) == 20.9
    assert round(count_params(get_preset("gpt-oss-120b")) / 1e9, 1) == 116.8
    cfg = get_preset("tiny-gpt-oss")
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == count_params(cfg)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"])
def test_presets_round_trip_through_config_json_whole(name):
    cfg = get_preset(name)
    d = config_to_hf(cfg)
    assert d["layer_types"][:2] == ["sliding_attention", "full_attention"] and d["attention_bias"] is True
    assert config_from_hf(d) == cfg


def test_a_sink_is_one_more_logit_in_every_softmax_with_no_value():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 8, generator=gen) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen)
    out = causal_attention(q, k, v, 0.3, window=3, sinks=sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) * 0.3
    i, j = torch.arange(6)[:, None], torch.arange(6)[None]
    s = s.masked_fill(~((j <= i) & (i - j < 3)), float("-inf"))
    e = s.exp()
    want = (e @ vv) / (e.sum(-1, keepdim=True) + sinks.exp().view(1, 4, 1, 1))
    torch.testing.assert_close(out, want)


def test_what_gpt_oss_cannot_express_is_refused_by_name():
    cfg = get_preset("tiny-gpt-oss")
    with pytest.raises(ModelError, match=r"gpt_oss always has attention sinks \(model.attention_sinks must be true"):
        config_to_hf(replace(cfg, attention_sinks=False))
    with pytest.raises(ModelError, match=r"model.moe.expert_activation='swiglu' cannot be exported as gpt_oss"):
        from tessera.checkpoint.hf.names import check_exportable

        check_exportable(replace(cfg, moe=replace(cfg.moe, expert_activation="swiglu")))


def test_context_parallelism_is_refused_for_attention_sinks_by_name():
    from tessera.config.layout_rules import LayoutSizes, layout_problems

    problems = layout_problems(get_preset("tiny-gpt-oss"), LayoutSizes(cp=2))
    assert any(p.startswith("cp=2 cannot attend with attention sinks (model.attention_sinks=true, gpt-oss)")
               for p in problems), problems
    assert not layout_problems(get_preset("tiny-gpt-oss"), LayoutSizes(ep=2, dp_shard=2))


def test_sinks_on_latent_attention_are_refused_by_name():
    from tessera.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.attention_sinks=True is invalid: needs grouped-query attention"):
        get_preset("tiny-deepseek", attention_sinks=True)
