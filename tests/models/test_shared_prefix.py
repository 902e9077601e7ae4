"""Shared-prefix rows (tessera/models/attention_variants/shared_prefix.py): a prompt and its continuations packed in one
row, each continuation attending to the prompt and itself at its own positions, give the logits of
each "prompt + continuation" run alone (fp32 1e-5), taken per row by a [B, R] `logit_positions`;
with a sliding window shorter than the row, Llama 4's chunks and attention sinks too, and with
padding, which no real token sees."""

from __future__ import annotations

import pytest
import torch

from tessera.config.model import ModelConfig
from tessera.models.attention import wide_causal_attention
from tessera.models.attention_variants.shared_prefix import PADDING, PREFIX, SharedPrefixMask
from tessera.models.model_input import ModelInput
from tessera.models.transformer import Transformer

PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 8]]
GROUPS = [[[12, 13, 14, 15], [16], [17, 18, 19]], [[20, 21, 22], [23, 24, 25, 26, 27]]]


def _model(**fields) -> Transformer:
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
                      **fields)
    torch.manual_seed(0)
    return Transformer(cfg).float().eval()


def _packed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """The groups in one row each (padded), and each continuation's row indices in it."""
    rows, where = [], []
    for prompt, group in zip(PROMPTS, GROUPS):
        ids, pos, seg, idx = list(prompt), list(range(len(prompt))), [PREFIX] * len(prompt), []
        for j, c in enumerate(group):
            idx.append(list(range(len(ids), len(ids) + len(c))))
            ids += c
            pos += range(len(prompt), len(prompt) + len(c))
            seg += [j + 1] * len(c)
        rows.append((ids, pos, seg))
        where.append(idx)
    S = max(len(r[0]) for r in rows) + 2  # two padding slots at least
    tokens, positions = torch.zeros(len(rows), S, dtype=torch.long), torch.zeros(len(rows), S, dtype=torch.long)
    segments = torch.full((len(rows), S), PADDING)
    for b, (ids, pos, seg) in enumerate(rows):
        tokens[b, :len(ids)], positions[b, :len(ids)], segments[b, :len(ids)] = (
            torch.tensor(ids), torch.tensor(pos), torch.tensor(seg))
    return tokens, positions, segments, where


@pytest.mark.parametrize("fields", [
    pytest.param({}, id="full"),
    pytest.param({"sliding_window": 3}, id="sliding-window"),
    pytest.param({"attention_chunk_size": 4}, id="chunks"),
    pytest.param({"attention_sinks": True}, id="sinks"),
])
def test_packed_continuations_give_the_logits_of_their_own_rows(fields):
    model = _model(**fields)
    if model.cfg.attention_sinks:
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attention.sinks.weight.normal_()
    tokens, positions, segments, where = _packed()
    # per row: the prompt's last position, then every continuation token's, padded with 0
    picks = [[len(p) - 1] + [i for idx in w for i in idx] for p, w in zip(PROMPTS, where)]
    R = max(len(r) for r in picks)
    index = torch.tensor([r + [0] * (R - len(r)) for r in picks])
    with torch.no_grad():
        packed = model(ModelInput(tokens=tokens, positions=positions, cache=SharedPrefixMask(segments, positions),
                                  logit_positions=index)).logits
        for b, (prompt, group) in enumerate(zip(PROMPTS, GROUPS)):
            column = 1
            for c in group:
                alone = model(torch.tensor([prompt + c])).logits[0]
                torch.testing.assert_close(packed[b, 0], alone[len(prompt) - 1], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(packed[b, column:column + len(c)], alone[len(prompt):], rtol=1e-5,
                                           atol=1e-5)
                column += len(c)


def test_no_real_token_sees_padding_and_padding_sees_something():
    _, positions, segments, _ = _packed()
    mask = SharedPrefixMask(segments, positions).mask(None)[:, 0]
    pad = segments == PADDING
    assert not (mask & pad[:, None, :] & ~pad[:, :, None]).any()  # a real query never sees a padding key
    assert mask.any(-1).all()  # every query sees at least one key
    seg = segments[0]
    first, second = (seg == 1).nonzero()[0, 0], (seg == 2).nonzero()[0, 0]
    assert not mask[0, second, first] and mask[0, second, 0]  # continuation 2 sees the prompt, not continuation 1


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-window"])
def test_in_float64_each_continuation_attends_as_wide_causal_attention_over_its_own_row(window):
    """GRPO's fp64_attention: the packed row's attention in float64, rounded back, equals to the bit what
    `wide_causal_attention` (the policy's core over one row per completion) gives each row alone, so the
    shared-prefix update scores as that core does (in fp32 the two sum in different orders)."""
    _, positions, segments, where = _packed()
    torch.manual_seed(1)
    B, S = segments.shape
    q, k, v = torch.randn(B, 4, S, 16), torch.randn(B, 2, S, 16), torch.randn(B, 2, S, 16)
    packed = SharedPrefixMask(segments, positions, torch.float64).attend(0, q, k, v, 0.25, window)
    assert packed.dtype == torch.float32
    for b, prompt in enumerate(PROMPTS):
        for idx in where[b]:
            rows = list(range(len(prompt))) + idx
            alone = wide_causal_attention(q[b:b + 1, :, rows], k[b:b + 1, :, rows], v[b:b + 1, :, rows], 0.25, window)
            assert torch.equal(packed[b, :, rows], alone[0])
