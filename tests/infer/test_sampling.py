"""Sampling: top-k / top-p, per-request seeds, stop tokens and stop strings, streaming text,
system prompts pinned in the prefix cache."""

import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.infer import LLM, SamplingParams
from tessera.infer.engine.detokenizer import IncrementalDetokenizer
from tessera.infer.sampling.sampler import processed_probs
from tests.infer.tiny_models import char_tokenizer


def test_top_k_top_p_and_greedy_distributions():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))  # 0.5 + 0.3 + 0.15 reaches 0.9
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    p = processed_probs(logits, SamplingParams(temperature=0.0))
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    sharp = processed_probs(logits, SamplingParams(temperature=0.5))
    assert sharp[0, 0] > 0.5


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_k=-1), dict(max_tokens=0),
                                 dict(stop=[""]), dict(seed=-3), dict(logit_bias={"\u00b2": 1.0}),
                                 dict(logit_bias={"5": "big"}), dict(logit_bias=[1]), dict(stop_token_ids=["x"])])
def test_out_of_range_params_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama):
    llm = LLM(llama[0], block_size=4)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    alone = llm.generate(["sample me"], params)[0].token_ids
    batch = llm.generate(["other", "sample me", "more text here"],
                         [SamplingParams(max_tokens=9, temperature=0.7, seed=1), params,
                          SamplingParams(max_tokens=20, temperature=1.0)])
    assert batch[1].token_ids == alone
    other_seed = llm.generate(["sample me"], SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_stop_tokens_and_stop_strings(llama):
    llm = LLM(llama[0], block_size=4)
    free = llm.generate(["stop here"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(["stop here"], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    assert out.text == llm.tokenizer.decode(free.token_ids[:first])  # the stop token is not in the text
    stop_str = free.text[6:8]
    cut = free.text.find(stop_str)
    out = llm.generate(["stop here"], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop_str, "\x00never"]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[:cut]
    # the engine's output names the stop string that ended it (the Messages API's stop_sequence), none for a token
    assert _last_output(llm, SamplingParams(max_tokens=20, temperature=0.0, stop=["\x00never", stop_str])).stop_string \
        == stop_str
    assert _last_output(llm, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_tok])).stop_string \
        is None


def _last_output(llm: LLM, params: SamplingParams):
    """The finished engine output of "stop here" under `params`."""
    rid = llm.engine.add_request(llm.encode("stop here"), params)
    while True:
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                return out


def test_streamed_text_never_sends_a_partial_stop_string():
    tok = char_tokenizer()
    ids = tok.encode("hello world STOP more", add_special_tokens=False).ids

    class Decoder:
        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    d = IncrementalDetokenizer(Decoder(), ["STOP"])
    sent = []
    for t in ids:
        stopped = d.add(t)
        sent.append(d.release(final=stopped))
        assert "S" not in "".join(sent)
        if stopped:
            break
    assert stopped and "".join(sent) == "hello world "


def test_system_prompts_are_prefilled_and_pinned(llama):
    system = "You are a helpful assistant. Answer briefly and precisely.\n"
    llm = LLM(llama[0], block_size=4, num_blocks=64, max_model_len=128, system_prompts=[system])
    bm = llm.engine.blocks
    pinned = bm.num_pinned_blocks
    assert pinned == len(llm.tokenizer.encode(system)) // 4
    llm.generate([system + "User: hi"], SamplingParams(max_tokens=4, temperature=0.0))
    assert bm.cache.hit_tokens == pinned * 4
    llm.generate([f"unrelated prompt {i} " * 4 for i in range(8)], SamplingParams(max_tokens=8, temperature=0.0))
    assert bm.num_pinned_blocks == pinned and bm.num_free_blocks == 64 - pinned
    before = bm.cache.hit_tokens
    llm.generate([system + "User: again"], SamplingParams(max_tokens=4, temperature=0.0))
    assert bm.cache.hit_tokens - before == pinned * 4
