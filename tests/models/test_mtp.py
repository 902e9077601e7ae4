"""Multi-token prediction (model.mtp_depth, tessera/models/mtp.py) in every family: each depth's
loss equals DeepSeek-V3's equations written out here step by step from the model's own parts, the
block is the family's (its attention, MLA, MoE placement), the embedding and head are the main
model's, and a model with mtp_depth 0 is the model without it, tensor for tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.config.errors import ConfigError
from tessera.config.hf_config import config_from_hf
from tessera.config.model import ModelConfig
from tessera.config.presets import get_preset
from tessera.models.counting import count_params
from tessera.models.model_input import ModelInput
from tessera.models.transformer import Transformer
from tests.models.hf_families import hf_configs

FAMILIES = sorted(hf_configs())


def _cfg(case: str, **extra) -> ModelConfig:
    cfg = config_from_hf(hf_configs()[case].to_dict())
    for key, value in extra.items():
        setattr(cfg, key, value)
    cfg.validate()
    return cfg


def _by_hand(model: Transformer, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's summed cross-entropy, DeepSeek-V3 section 2.2 written out over the valid
    positions only (S - k per row), from the model's own parameters."""
    S = ids.shape[1]
    pos = torch.arange(S).expand(ids.shape[0], S)
    tables = model.rope_tables(pos, torch.float32)  # RoPE's cos / sin, and the window layers' own (OLMo 3)
    cos, sin = tables.cos, tables.sin
    h = model.tok_embeddings(ids)
    for key, layer in model.layers.items():
        h, _ = layer(h, *tables.of_layer(model.cfg, int(key)))
    head = model.output.weight if model.output is not None else model.tok_embeddings.weight
    sums = []
    for k in range(1, model.cfg.mtp_depth + 1):
        m = model.mtp[str(k)]
        e = model.tok_embeddings(ids[:, k:])
        # positions 0..S-k-1 of depth k; the causal block never looks right, so cutting is exact
        x = m.eh_proj(torch.cat([m.enorm(e), m.hnorm(h[:, :S - k])], dim=-1))
        h, _ = m.block(x, cos[:, :S - k], sin[:, :S - k])
        logits = m.norm(h) @ head.T
        sums.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, k:].reshape(-1), reduction="sum"))
    return sums


@pytest.mark.parametrize("case", FAMILIES)
def test_every_depths_loss_is_deepseek_v3s_equations_in_every_family(case):
    if hf_configs()[case].model_type == "nemotron_h":  # single sublayers: no decoder layer to predict with
        with pytest.raises(ConfigError, match="model.mtp_depth=2 is invalid: 0 for a model of single sublayers"):
            _cfg(case, mtp_depth=2, mtp_loss_weight=0.25)
        return
    cfg = _cfg(case, mtp_depth=2, mtp_loss_weight=0.25)
    torch.manual_seed(0)
    model = Transformer(cfg, init_seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    targets = torch.randint(0, cfg.vocab_size, (2, 12))
    out = model(ModelInput(tokens=ids, targets=targets))
    want = _by_hand(model, ids, targets)
    assert sorted(out.mtp_loss_sums) == [1, 2]
    for k, w in enumerate(want, start=1):
        torch.testing.assert_close(out.mtp_loss_sums[k], w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.mtp_loss_sum, 0.25 / 2 * (want[0] + want[1]), rtol=1e-5, atol=1e-5)
    # the block of depth k is the family's layer n_layers + k - 1: same attention kind and MoE rule
    for k in (1, 2):
        block = model.mtp[str(k)].block
        assert type(block.attention) is type(model.layers[str(cfg.n_layers - 1)].attention)  # a hybrid: attention
        assert hasattr(block, "moe") == cfg.is_moe_layer(cfg.n_layers + k - 1)
    # the embedding and head are shared: depth 1's loss moves them, no copy of them exists
    out.mtp_loss_sums[1].backward()
    assert model.tok_embeddings.weight.grad.abs().sum() > 0
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("mtp.") and ("embed" in n or n.endswith("output.weight")) for n in names)


def test_masked_targets_and_short_rows_count_no_loss():
    cfg = _cfg("llama", mtp_depth=3)
    model = Transformer(cfg, init_seed=1)
    ids = torch.randint(0, cfg.vocab_size, (1, 3))
    targets = torch.full((1, 3), -100)
    targets[0, 0] = 5  # depth k reads target k.. only: nothing is left for any depth
    out = model(ModelInput(tokens=ids, targets=targets))
    assert all(float(v.detach()) == 0.0 for v in out.mtp_loss_sums.values())


def test_depth_zero_is_the_model_without_multi_token_prediction():
    cfg = _cfg("qwen3")
    plain = Transformer(cfg, init_seed=2)
    with_mtp = Transformer(_cfg("qwen3", mtp_depth=1), init_seed=2)
    shared = {n: p for n, p in with_mtp.named_parameters() if not n.startswith("mtp.")}
    assert set(shared) == {n for n, _ in plain.named_parameters()}
    assert all(torch.equal(shared[n], p) for n, p in plain.named_parameters())
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    a, b = plain(ModelInput(tokens=ids, targets=ids)), with_mtp(ModelInput(tokens=ids, targets=ids))
    assert torch.equal(a.logits, b.logits) and not a.mtp_loss_sums and a.mtp_loss_sum is None


@pytest.mark.parametrize("key,value", [("mtp_depth", -1), ("mtp_depth", 17), ("mtp_loss_weight", -0.1),
                                       ("mtp_loss_weight", float("nan"))])
def test_bad_settings_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=f"model.{key}"):
        _cfg("llama", **{key: value})


def test_deepseek_v3s_published_count_with_its_mtp_module():
    # DeepSeek-V3's report: 671B main-model parameters plus 14B in its MTP module, 685B on HuggingFace,
    # whose MTP layer stores its own copies of the embedding and the head; Tessera shares them
    cfg = get_preset("deepseek-v3", mtp_depth=1)
    copies = 2 * cfg.vocab_size * cfg.dim
    assert 684.0 <= (count_params(cfg) + copies) / 1e9 <= 685.0  # 684.5B: HuggingFace shows 685B
