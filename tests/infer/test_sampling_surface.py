"""The OpenAI sampling surface over real HTTP on 127.0.0.1, with transformers as the oracle:
log-probabilities (completions `logprobs: k`, chat `logprobs`/`top_logprobs`, streamed and not),
`echo` with prompt log-probabilities, presence/frequency/repetition penalties and `logit_bias`
against a reference computed by hand from transformers' logits, `seed`, `n` > 1, bad values
refused with a 400 naming the field and its range, and requests with these options batched with
plain greedy ones without changing them."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tessera.infer import EngineConfig, LLMEngine
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.tiny_models import hf_greedy

LONG = "The quick brown fox jumps over the lazy dog"  # longer than the token budget: prefilled in chunks


@pytest.fixture(scope="module")
def server(llama):
    path, _ = llama
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, max_num_seqs=16, max_num_batched_tokens=16))
    with RunningServer(engine, name="tiny") as s:
        yield s


def _post(server, body: dict, chat: bool = False) -> dict:
    route = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(server.url + route, json={"model": "tiny", **body}, timeout=HANG_S)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, body: dict, chat: bool = False) -> list[dict]:
    route = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", server.url + route, json={"model": "tiny", "stream": True, **body},
                      timeout=HANG_S) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_logprobs_equal_transformers(server, llama):
    hf, tok = llama[1], server.engine.tokenizer
    prompt = tok.encode("hello world")
    out = _post(server, {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 5})
    lp = out["choices"][0]["logprobs"]
    completion = hf_greedy(hf, prompt, 6)
    ref = _log_softmax(hf, prompt + completion)
    assert lp["tokens"] == [tok.decode([t]) for t in completion]
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    for i, t in enumerate(completion):
        row = ref[len(prompt) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(row[t].item(), abs=1e-4)
        values, ids = row.topk(5)
        expected = {tok.decode([t]): row[t].item()} | {tok.decode([j]): v for j, v in zip(ids.tolist(),
                                                                                         values.tolist())}
        assert lp["top_logprobs"][i] == pytest.approx(expected, abs=1e-4)
        assert max(lp["top_logprobs"][i].values()) == lp["token_logprobs"][i]  # greedy: its token is the top


def test_sampled_tokens_logprobs_are_of_the_raw_distribution(server, llama):
    """With temperature and top-k the reported log-probabilities are still log_softmax of the raw
    logits (vLLM's default), for whatever tokens were drawn."""
    hf, tok = llama[1], server.engine.tokenizer
    out = _post(server, {"prompt": "abc", "max_tokens": 5, "temperature": 1.5, "top_k": 3, "seed": 3,
                         "ignore_eos": True, "logprobs": 0})
    lp = out["choices"][0]["logprobs"]
    prompt = tok.encode("abc")
    completion = tok.encode(out["choices"][0]["text"], add_special_tokens=False)
    ref = _log_softmax(hf, prompt + completion)
    for i, t in enumerate(completion):
        assert lp["token_logprobs"][i] == pytest.approx(ref[len(prompt) - 1 + i, t].item(), abs=1e-4)
        assert list(lp["top_logprobs"][i]) == [lp["tokens"][i]]  # k = 0: the token itself only


@pytest.mark.parametrize("prompt", [LONG, "as token ids"])
def test_echo_prompt_logprobs_equal_transformers(server, llama, prompt):
    hf, tok = llama[1], server.engine.tokenizer
    ids = tok.encode(LONG)
    sent = ids if prompt == "as token ids" else LONG
    out = _post(server, {"prompt": sent, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1})
    c = out["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(tok.decode(ids) if prompt == "as token ids" else LONG)
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _log_softmax(hf, ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        best = ref[i - 1].argmax().item()
        assert lp["top_logprobs"][i][tok.decode([best])] == pytest.approx(ref[i - 1, best].item(), abs=1e-4)
    assert lp["token_logprobs"][-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)  # the generated token


def test_echo_without_logprobs_prepends_the_prompt(server, llama):
    plain = _post(server, {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    echoed = _post(server, {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True})
    assert echoed["choices"][0]["text"] == "hello" + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None


def test_chat_logprobs_equal_transformers(server, llama):
    hf, tok = llama[1], server.engine.tokenizer
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3}
    out = _post(server, body, chat=True)
    content = out["choices"][0]["logprobs"]["content"]
    prompt = tok.encode("<user>hi\n<assistant>", add_special_tokens=False)
    completion = hf_greedy(hf, prompt, 4)
    ref = _log_softmax(hf, prompt + completion)
    assert [c["token"] for c in content] == [tok.decode([t]) for t in completion]
    for i, (entry, t) in enumerate(zip(content, completion)):
        row = ref[len(prompt) - 1 + i]
        assert entry["logprob"] == pytest.approx(row[t].item(), abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode())
        values, ids = row.topk(3)
        assert [e["token"] for e in entry["top_logprobs"]] == [tok.decode([j]) for j in ids.tolist()]
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)
    plain = _post(server, {**body, "logprobs": False, "top_logprobs": None}, chat=True)
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"] == out["choices"][0]["message"]


def test_streamed_logprobs_equal_the_non_streamed_ones(server):
    body = {"prompt": LONG, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 2}
    whole = _post(server, body)["choices"][0]
    chunks = [c["choices"][0] for c in _stream(server, body) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    merged = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in whole["logprobs"]}
    assert merged == whole["logprobs"]

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    whole = _post(server, chat, chat=True)["choices"][0]
    chunks = [c["choices"][0] for c in _stream(server, chat, chat=True) if c["choices"]]
    assert [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]] == whole["logprobs"]["content"]


def _reference(hf, prompt: list[int], steps: int, bias=None, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding on transformers' logits changed by hand as OpenAI and vLLM define it."""
    ids, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float().clone()
        for t, b in (bias or {}).items():
            logits[t] += b
        for t in set(ids):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, count in Counter(out).items():
            logits[t] -= frequency * count + presence
        ids.append(int(logits.argmax()))
        out.append(ids[-1])
    return out


PENALTIES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8},
    {"presence_penalty": -0.5, "frequency_penalty": 2.0},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6},
    {"logit_bias": {"40": 8.0, "70": -100}},
    {"logit_bias": {"50": 5.5}, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
]


@pytest.mark.parametrize("options", PENALTIES, ids=lambda o: ",".join(o))
def test_penalties_and_logit_bias_equal_a_reference_from_transformers_logits(server, llama, options):
    hf, tok = llama[1], server.engine.tokenizer
    prompt = tok.encode("aaaa")
    steps = 8
    expected = _reference(hf, prompt, steps, {int(k): v for k, v in options.get("logit_bias", {}).items()},
                          options.get("presence_penalty", 0.0), options.get("frequency_penalty", 0.0),
                          options.get("repetition_penalty", 1.0))
    assert expected != hf_greedy(hf, prompt, steps)  # the option changes the output: the test can fail
    out = _post(server, {"prompt": prompt, "max_tokens": steps, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                         **options})
    assert out["choices"][0]["logprobs"]["tokens"] == [tok.decode([t]) for t in expected]  # special ones too


def test_seed_is_reproducible_and_independent_of_the_batch(server):
    body = {"prompt": "once", "max_tokens": 10, "temperature": 1.0, "ignore_eos": True, "seed": 1234,
            "presence_penalty": 0.5}
    alone = _post(server, body)["choices"][0]["text"]
    others = [{"prompt": p, "max_tokens": 12, "temperature": 0.9, "ignore_eos": True} for p in ("x", LONG, "yy")]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: _post(server, b), [*others, body, *others, body]))
    assert results[3]["choices"][0]["text"] == alone and results[7]["choices"][0]["text"] == alone
    texts = {_post(server, {**body, "seed": s})["choices"][0]["text"] for s in range(4)}
    assert len(texts) > 1  # the seed matters


def test_n_gives_n_independent_choices(server):
    out = _post(server, {"prompt": ["ab", "cd"], "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 9,
                         "ignore_eos": True, "logprobs": 1})
    choices = out["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert all(len(c["logprobs"]["tokens"]) == 8 for c in choices)
    assert len({c["text"] for c in choices[:3]}) > 1 and len({c["text"] for c in choices[3:]}) > 1
    assert out["usage"]["prompt_tokens"] == 2 * 3  # each prompt counted once (<s> + 2 characters)
    assert out["usage"]["completion_tokens"] == 6 * 8
    again = _post(server, {"prompt": ["ab", "cd"], "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 9,
                           "ignore_eos": True})
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in choices]
    chat = _post(server, {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4,
                          "temperature": 0, "ignore_eos": True}, chat=True)
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]  # greedy: the same twice
    streamed = _stream(server, {"prompt": "ab", "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 9,
                                "ignore_eos": True})
    for i in range(2):
        text = "".join(c["choices"][0]["text"] for c in streamed if c["choices"] and c["choices"][0]["index"] == i)
        assert text == choices[i]["text"][:len(text)] and text


@pytest.mark.parametrize("route, field, value, allowed", [
    ("completions", "logprobs", 21, "[0, 20]"),
    ("completions", "logprobs", -1, "[0, 20]"),
    ("completions", "logprobs", "3", "integer"),
    ("chat", "top_logprobs", 21, "[0, 20]"),
    ("chat", "top_logprobs", 2, "'logprobs': true"),
    ("chat", "logprobs", 3, "boolean"),
    ("completions", "top_logprobs", 2, "'logprobs': k"),
    ("completions", "echo", "yes", "boolean"),
    ("chat", "echo", True, "/v1/completions only"),
    ("completions", "n", 0, "[1, 16]"),
    ("completions", "n", 17, "[1, 16]"),
    ("completions", "best_of", 3, "equal to 'n'"),
    ("completions", "presence_penalty", 2.5, "[-2, 2]"),
    ("chat", "frequency_penalty", -3, "[-2, 2]"),
    ("completions", "repetition_penalty", 0, "> 0"),
    ("completions", "repetition_penalty", -1.0, "> 0"),
    ("completions", "logit_bias", {"5": 101}, "[-100, 100]"),
    ("completions", "logit_bias", {"5": "big"}, "[-100, 100]"),
    ("completions", "logit_bias", {"x": 1}, "token ids"),
    ("completions", "logit_bias", {"\u00b2": 1}, "token ids"),  # str.isdigit() takes it, int() does not
    ("chat", "logit_bias", {"128": 1}, "0..127"),
    ("completions", "logit_bias", [1, 2], "an object"),
    ("completions", "seed", -1, "[0, 2^63)"),
    ("completions", "suffix", "x", "not supported"),
])
def test_bad_values_get_400_naming_the_field_and_the_allowed_range(server, route, field, value, allowed):
    chat = route == "chat"
    body = {"messages": [{"role": "user", "content": "a"}]} if chat else {"prompt": "a"}
    if field == "top_logprobs" and chat and allowed.startswith("'logprobs'"):
        body["logprobs"] = False
    elif field == "top_logprobs" and chat:
        body["logprobs"] = True
    r = httpx.post(server.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                   json={"model": "tiny", "max_tokens": 2, **body, field: value}, timeout=HANG_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"{field}" in error["message"] and allowed in error["message"], error


def test_requests_with_options_leave_plain_greedy_ones_in_their_batch_unchanged(server, llama):
    hf, tok = llama[1], server.engine.tokenizer
    plain = [{"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True} for p in ("hello world", LONG, "z")]
    fancy = [{"prompt": LONG, "max_tokens": 10, "echo": True, "logprobs": 5, "temperature": 0.7, "seed": 1},
             {"prompt": "hello world", "max_tokens": 10, "logit_bias": {"60": 50}, "repetition_penalty": 1.5,
              "frequency_penalty": 1.0, "n": 3, "temperature": 0.8, "ignore_eos": True},
             {"prompt": [999], "max_tokens": 3}]  # refused alone

    def post(body):
        return httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=HANG_S)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(post, [fancy[0], plain[0], fancy[1], plain[1], fancy[2], plain[2], fancy[0]]))
    assert results[4].status_code == 400
    assert [r.status_code for i, r in enumerate(results) if i != 4] == [200] * 6
    for body, r in zip(plain, (results[1], results[3], results[5])):
        ids = tok.encode(body["prompt"])
        assert tok.encode(r.json()["choices"][0]["text"], add_special_tokens=False) == hf_greedy(hf, ids, 10)
    first, again = results[0].json()["choices"][0], results[6].json()["choices"][0]  # seeded: the same twice
    assert first["text"] == again["text"] and first["logprobs"]["tokens"] == again["logprobs"]["tokens"]
    assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(again["logprobs"]["token_logprobs"][1:], abs=1e-4)


def _run_engine(engine, prompts, params):
    rids = [engine.add_request(engine.tokenizer.encode(p), sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[r] for r in rids]


def _values(entries):
    return [(e.token_id, [t for t, _ in e.top]) for e in entries], [v for e in entries
                                                                    for v in (e.logprob, *(v for _, v in e.top))]


@pytest.mark.dist
@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_the_same_logprobs_and_penalised_tokens(llama):
    """Rank 0 samples from the gathered full-vocabulary rows, so every option works under tensor
    parallelism and gives what one rank gives (and transformers' log_softmax)."""
    from tessera.infer import LLM, SamplingParams

    path, hf = llama
    options = dict(block_size=4, max_num_batched_tokens=20, enable_prefix_caching=False)
    prompts = [LONG, "aaaa", "hello"]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                             frequency_penalty=0.8, logit_bias={40: 8.0}, logprobs=0),
              SamplingParams(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True, presence_penalty=1.0)]
    one = _run_engine(LLM(path, **options).engine, prompts, params)
    with LLM(path, tensor_parallel_size=2, **options) as two:
        other = _run_engine(two.engine, prompts, params)
    assert [o.token_ids for o in other] == [o.token_ids for o in one]
    for a, b in zip(one, other):
        for mine, theirs in ((a.logprobs, b.logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert _values(mine)[0] == _values(theirs)[0]
                assert _values(mine)[1] == pytest.approx(_values(theirs)[1], abs=1e-4)
    long_ids = [0] + [ord(c) - 29 for c in LONG]  # the character tokenizer: <s>, one token per character
    ref = _log_softmax(hf, long_ids)
    assert [e.logprob for e in other[0].prompt_logprobs] == pytest.approx(
        [ref[i, t].item() for i, t in enumerate(long_ids[1:])], abs=1e-4)
    assert other[1].token_ids == _reference(hf, [0] + [ord(c) - 29 for c in "aaaa"], 6, {40: 8.0}, 0.0, 0.8, 1.8)
    assert one[0].prompt_tokens == len(long_ids)
