"""Structured output: every completion under a JSON schema parses and validates, from random-weight
models sampling at temperature 1 (which write garbage without the mask, checked alongside), with
the character tokenizer of the tiny models and the bundled byte-level BPE tokenizer; json_object
mode; both HTTP endpoints on 127.0.0.1; invalid schemas refused with a 400, and so is one the grammar
engine fails on while decoding; a free request in the same batch unchanged; speculative decoding falls
back to one token per step for such requests."""

import json
import shutil
import threading

import httpx
import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.data.tokenizer import DEFAULT_TOKENIZER_DIR
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.infer.config import SpeculativeConfig
from tessera.infer.sampling.structured_output import unpack_bitmask
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.test_server import _hold_engine, _wait_for_inbox
from tests.infer.tiny_models import write_model

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                            "shade": {"type": "string", "enum": ["light", "dark"]}},
          "required": ["colour", "shade"], "additionalProperties": False}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 2, "maxItems": 5}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 999},
    "owner": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                        "maxItems": 3}},
              "required": ["ok", "tags"], "additionalProperties": False}},
    "required": ["id", "owner"], "additionalProperties": False}
RANGE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 99},
                                          "x": {"type": "number", "minimum": 0, "maximum": 1}},
         "required": ["n", "x"], "additionalProperties": False}
SCHEMAS = {"required_fields": PERSON, "enums": COLOUR, "array": SCORES, "nested": NESTED, "integer_range": RANGE}
SEEDS = range(6)


def as_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(llama[0], block_size=4)


@pytest.fixture(scope="module")
def bpe_llm(tmp_path_factory):
    """A random Llama over the bundled byte-level BPE tokenizer (vocabulary 4096)."""
    path = tmp_path_factory.mktemp("bpe-llama")
    write_model(path, "llama", std=0.25, vocab_size=4096, eos_token_id=0, bos_token_id=None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_TOKENIZER_DIR / name, path / name)
    return LLM(path, block_size=4)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_completion_validates_and_free_sampling_does_not(llm, name):
    schema = SCHEMAS[name]
    constrained = [SamplingParams(max_tokens=150, temperature=1.0, seed=s, response_format=as_format(schema))
                   for s in SEEDS]
    for out in llm.generate(["Answer:"] * len(SEEDS), constrained):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    free = [SamplingParams(max_tokens=150, temperature=1.0, seed=s) for s in SEEDS]
    assert not any(validates(o.text, schema) for o in llm.generate(["Answer:"] * len(SEEDS), free))


def test_bpe_tokenizer_completions_validate(bpe_llm):
    for schema in (PERSON, NESTED, SCORES):
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, response_format=as_format(schema, False))
                  for s in SEEDS]
        outs = bpe_llm.generate(["def main():"] * len(SEEDS), params)
        for out in outs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)
        free = [SamplingParams(max_tokens=120, temperature=1.0, seed=s) for s in SEEDS]
        assert not any(validates(o.text, schema) for o in bpe_llm.generate(["def main():"] * len(SEEDS), free))


def test_json_object_mode_yields_objects(llm, bpe_llm):
    """Any object is allowed, so a random model may write one string until max_tokens (as with
    OpenAI's JSON mode, the output is then cut, finish_reason "length"); every one that ends is
    an object."""
    for engine in (llm, bpe_llm):
        params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, response_format={"type": "json_object"})
                  for s in range(8)]
        outs = engine.generate(["Reply in JSON:"] * 8, params)
        ended = [o for o in outs if o.finish_reason == "stop"]
        assert len(ended) >= 3, [o.text for o in outs]
        for out in ended:
            assert isinstance(json.loads(out.text), dict)
        for out in outs:
            assert out.text.startswith("{") and (out.finish_reason == "stop" or len(out.token_ids) == 200)
    text_mode = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, response_format={"type": "text"})
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert llm.generate("x", text_mode)[0].token_ids == llm.generate("x", plain)[0].token_ids


def test_free_request_in_a_mixed_batch_equals_its_output_alone(llama):
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4))
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = engine.tokenizer.encode("the free one")

    def run(requests):
        ids = [engine.add_request(p, params) for p, params in requests]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    alone = run([(prompt, free)])[0]
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=3, response_format=as_format(NESTED))
    both = run([(engine.tokenizer.encode("json please"), constrained), (prompt, free)])
    assert both[1].token_ids == alone.token_ids
    jsonschema.validate(json.loads(both[0].text), NESTED)
    greedy = run([(prompt, SamplingParams(max_tokens=60, temperature=0.0, response_format=as_format(PERSON)))])[0]
    jsonschema.validate(json.loads(greedy.text), PERSON)


def test_invalid_schemas_are_refused_before_queueing(llm):
    bad = [({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}, "Invalid type: foo"),
           ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/nope"}}}, "/nope"),
           ({"type": "json_schema", "json_schema": {"name": "a"}}, "json_schema.schema"),
           ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "json_schema.name"),
           ({"type": "xml"}, "'type' must be one of"),
           ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict")]
    for response_format, fragment in bad:
        with pytest.raises(ConfigError, match="response_format") as caught:
            llm.generate("x", SamplingParams(response_format=response_format))
        assert fragment in str(caught.value)
    assert not llm.engine.has_unfinished()


def test_unsatisfiable_schema_is_refused(llm):
    never = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}}, "required": ["a"]}
    with pytest.raises(ConfigError, match="Unsatisfiable schema"):
        llm.generate("x", SamplingParams(max_tokens=40, temperature=1.0, seed=0, response_format=as_format(never)))
    assert not llm.engine.has_unfinished()


def test_adding_a_request_looks_its_schema_up_once(llm, monkeypatch):
    """validate_request hands back the matcher it built and add_request keeps it, so the engine
    thread never looks a schema up (or compiles it again) twice for one request."""
    engine = llm.engine
    calls = []
    real = engine.grammars.matcher

    def matcher(response_format):
        calls.append(response_format)
        return real(response_format)

    monkeypatch.setattr(engine.grammars, "matcher", matcher)
    assert engine.validate_request(3, SamplingParams(), None) is None  # free text has no grammar
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=1, response_format=as_format(PERSON))
    first, second = engine.validate_request(3, params, None), engine.validate_request(3, params, None)
    assert first is not None and second is not None and first.matcher is not second.matcher  # one per request
    calls.clear()
    rid = engine.add_request(engine.tokenizer.encode("Answer:"), params)
    assert len(calls) == 1
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    jsonschema.validate(json.loads(done[rid].text), PERSON)


def test_speculative_decoding_falls_back_to_single_tokens_for_schema_requests(llama):
    spec = LLM(llama[0], block_size=4, speculative=SpeculativeConfig(method="prompt_lookup", num_tokens=3))
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=s, response_format=as_format(PERSON)) for s in SEEDS]
    for out in spec.generate(["Answer:"] * len(SEEDS), params):
        jsonschema.validate(json.loads(out.text), PERSON)
    assert spec.engine.metrics.spec_steps == 0
    spec.generate("ab ab ab ab ab", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert spec.engine.metrics.spec_steps > 0  # the free request still speculates


def test_unpack_bitmask_reads_bit_j_of_word_w_as_token_32w_plus_j():
    words = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32)
    expect = [[(int(words[n, t // 32]) >> (t % 32)) & 1 == 1 for t in range(100)] for n in range(3)]
    assert unpack_bitmask(words, 100).tolist() == expect


@pytest.fixture(scope="module")
def server(llama):
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, max_num_seqs=16))
    with RunningServer(engine, name="tiny") as s:
        yield s


def test_both_endpoints_follow_the_schema(server):
    fmt = as_format(NESTED)
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 120, "temperature": 1.0,
            "response_format": fmt}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["text"]), NESTED)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0,
            "response_format": fmt}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=HANG_S)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), NESTED)
    chat["response_format"] = as_format(PERSON, strict=False)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=HANG_S) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("response_format, fragment", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}, "Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"minLength": "x"}}}, "minLength"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}, "json_schema.schema"),
    ({"type": "yaml"}, "'type' must be one of"),
    ("json", "'response_format' must be an object"),
])
def test_invalid_response_format_gets_400_naming_the_problem(server, response_format, fragment):
    for route, extra in (("/v1/completions", {"prompt": "x"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(server.url + route, json={"model": "tiny", "response_format": response_format, **extra},
                       timeout=HANG_S)
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.wait_idle()


def test_a_schema_the_grammar_engine_fails_on_while_decoding_gets_400_alone(server):
    """An anyOf of 2001 branches compiles, then exceeds llguidance's parser row limit (2000) at the
    first token: the request fails as a client error naming its schema (400, and an error event
    with code 400 when streaming), while a free request in the same batch completes as alone."""
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                        for i in range(2001)]}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}
    free = {"model": "tiny", "prompt": "the free one", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(server.url + "/v1/completions", json=free, timeout=HANG_S).json()["choices"][0]["text"]
    bad = {"model": "tiny", "max_tokens": 40, "temperature": 1.0, "seed": 0, "response_format": fmt}
    results: dict = {}

    def send(key, route, body):
        if body.get("stream"):
            with httpx.stream("POST", server.url + route, json=body, timeout=HANG_S) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
                results[key] = (r.status_code, events)
        else:
            results[key] = httpx.post(server.url + route, json=body, timeout=HANG_S)

    chat = {**bad, "messages": [{"role": "user", "content": "x"}]}
    threads = [threading.Thread(target=send, args=args) for args in (
        ("completion", "/v1/completions", {**bad, "prompt": "x"}), ("chat", "/v1/chat/completions", chat),
        ("stream", "/v1/chat/completions", {**chat, "stream": True}), ("free", "/v1/completions", free))]
    gate = _hold_engine(server)  # all four in one batch
    for t in threads:
        t.start()
    _wait_for_inbox(server, 4)
    gate.set()
    for t in threads:
        t.join()
    for key in ("completion", "chat"):
        r = results[key]
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
        assert "structured output failed" in error["message"] and "max is 2000" in error["message"]
        assert "simplify" in error["message"] and "numerical" not in error["message"]
    status, events = results["stream"]
    assert status == 200 and events[-1]["error"]["code"] == 400
    assert "structured output failed" in events[-1]["error"]["message"]
    assert results["free"].status_code == 200 and results["free"].json()["choices"][0]["text"] == alone
    assert server.wait_idle() and httpx.get(server.url + "/health").status_code == 200


def test_missing_library_or_tokenizer_is_named(monkeypatch):
    from tessera.infer.sampling.structured_output import GrammarCompiler, GrammarError

    with pytest.raises(GrammarError, match="needs a tokenizer"):
        GrammarCompiler(None, 128, frozenset({1})).matcher({"type": "json_object"})
    assert GrammarCompiler(None, 128, frozenset()).matcher({"type": "text"}) is None  # free text needs neither
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)
    with pytest.raises(GrammarError, match=r"pip install 'tessera\[structured\]'"):
        GrammarCompiler(None, 128, frozenset({1})).matcher({"type": "json_object"})
