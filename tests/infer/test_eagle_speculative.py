"""Speculative decoding with an EAGLE-3 draft head (`speculative.method="eagle"`,
tessera/infer/runner/eagle_proposer.py) through the existing verification: greedy output is the output
without speculation (a draft over the target's vocabulary and one over a smaller one placed by d2t),
sampled output keeps the target's distribution, requests under a JSON schema decode one token per
step, a draft that does not fit the target is refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tessera.checkpoint.eagle_dir import save_eagle_draft
from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.models.eagle import EagleDraft, draft_layer_config
from tessera.models.transformer import Transformer
from tests.infer.test_mtp_speculative import (
    assert_a_cached_prefix_drafts_nothing_and_decodes_exactly,
    assert_schema_requests_never_draft,
)
from tests.infer.test_rejection_sampling import assert_sampled_tokens_keep_the_target


def _target(seed: int = 0, **cfg) -> Transformer:
    shape = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=128)
    shape.update(cfg)
    return Transformer(ModelConfig(**shape), init_seed=seed).eval()


def _draft_dir(target: Transformer, path, seed: int = 0, draft_vocab: int | None = None, std: float = 0.02,
               copy_last: bool = True):
    """An EAGLE-3 directory of a random draft for `target`, its head and final norm the target's (as
    training starts it). With `copy_last` its fused feature is the target's last layer's output and
    its layer adds little to it, so it drafts the target's prediction one position late: right
    where the target repeats itself, as these random targets do, wrong elsewhere."""
    cfg = draft_layer_config(target.cfg)
    L, D = target.cfg.n_layers, target.cfg.dim
    layers = tuple(min(j, L) for j in (1, 2, 3))
    draft = EagleDraft(replace(cfg, init_std=std), layers, D, draft_vocab)
    draft.init_weights(seed)
    with torch.no_grad():
        if copy_last:
            draft.fc.weight.zero_()
            draft.fc.weight[:, 2 * D:].copy_(torch.eye(D))
        if draft_vocab is None:
            draft.lm_head.weight.copy_(target.head_weight())
        else:  # the target's first tokens, then every other one
            d2t = torch.tensor([d if d < draft_vocab // 2 else d + (d - draft_vocab // 2) for d in
                                range(draft_vocab)]) - torch.arange(draft_vocab)
            draft.d2t.copy_(d2t)
            draft.lm_head.weight.copy_(target.head_weight()[torch.arange(draft_vocab) + d2t])
        draft.norm.weight.copy_(target.norm.weight)
    return str(save_eagle_draft(draft, path))


@pytest.mark.parametrize("k,draft_vocab", [(1, None), (3, None), (3, 40)])
def test_greedy_output_is_the_output_without_speculation(tmp_path, k, draft_vocab):
    model = _target(seed=1, init_std=0.3)
    draft = _draft_dir(model, tmp_path / "draft", seed=1, draft_vocab=draft_vocab)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [5] * 20, list(range(30, 50))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(model, block_size=4, enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(model, block_size=4, enable_prefix_caching=False,
              speculative=SpeculativeConfig(method="eagle", num_tokens=k, draft_model=draft))
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    m = llm.engine.metrics
    assert m.spec_proposed > 0 and m.spec_accepted > 0  # the head drafted, and some drafts held


def test_greedy_output_with_the_prefix_cache(tmp_path):
    """A prompt that hits cached blocks drafts nothing for them (their hidden states were never
    computed) and still decodes exactly."""
    model = _target(seed=2, init_std=0.3)
    draft = _draft_dir(model, tmp_path / "draft", seed=2)
    assert_a_cached_prefix_drafts_nothing_and_decodes_exactly(
        model, SpeculativeConfig(method="eagle", num_tokens=2, draft_model=draft))


def test_requests_with_a_json_schema_decode_one_token_per_step(tmp_path):
    from tessera.data.tokenizer import load_tokenizer
    from tests.infer.tiny_models import VOCAB, save_tokenizer

    save_tokenizer(tmp_path)
    model = _target(seed=3, vocab_size=VOCAB)
    llm = LLM(model, block_size=4, tokenizer=load_tokenizer(tmp_path),
              speculative=SpeculativeConfig(method="eagle", num_tokens=3,
                                            draft_model=_draft_dir(model, tmp_path / "draft")))
    assert_schema_requests_never_draft(llm)


def test_a_draft_that_does_not_fit_is_refused_by_name(tmp_path):
    draft = _draft_dir(_target(), tmp_path / "draft")
    with pytest.raises(ConfigError, match=r"speculative.draft_model=.* does not fit the served model: vocab_size=64"):
        LLM(_target(vocab_size=80), speculative=SpeculativeConfig(method="eagle", draft_model=draft))
    with pytest.raises(ConfigError, match="speculative.draft_model=None is invalid: method 'eagle' needs"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ConfigError, match="decode_batch_sizes"):
        LLM(_target(), decode_batch_sizes=[1, 2], speculative=SpeculativeConfig(method="eagle", draft_model=draft))


def test_tessera_serve_refuses_eagle_without_a_draft_directory(llama, capsys):
    from tessera.cli import main

    status = main(["serve", str(llama[0]), "--port", "0", "--device", "cpu", "--speculative", "eagle"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "tessera serve: error: " in err and "method 'eagle' needs the directory of a draft model" in err


@pytest.mark.slow
def test_sampling_with_eagle_drafts_keeps_the_target_distribution(tmp_path):
    """Second and third tokens (produced by verification) of 6000 seeded requests against the
    exact marginals computed from the target model, as the draft model's and MTP's tests check."""
    model = _target(seed=4, vocab_size=8, n_layers=1, init_std=0.5)
    draft = _draft_dir(model, tmp_path / "draft", seed=4, std=0.3, copy_last=False)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        two = torch.tensor([prompt + [a] for a in range(8)])
        p2 = torch.softmax(model(two).logits[:, -1], -1)
        three = torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])
        p3 = torch.softmax(model(three).logits[:, -1], -1).view(8, 8, 8)
    want2 = p1 @ p2
    want3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    llm = LLM(model, block_size=4, max_num_seqs=256, max_num_batched_tokens=2048, enable_prefix_caching=False,
              speculative=SpeculativeConfig(method="eagle", num_tokens=2, draft_model=draft))
    assert_sampled_tokens_keep_the_target(llm, prompt, want2, want3)
