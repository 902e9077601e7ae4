"""LoRA adapters on the models of one server (`tessera serve --model NAME=PATH ... --lora MODEL:ADAPTER=DIR`,
tessera/infer/fleet/model_adapters.py), over real HTTP on 127.0.0.1: a request's `model` naming
`MODEL:ADAPTER`, or an adapter's name that one model only has, answers as PEFT's greedy generation of
that adapter on that model; the base models answer as themselves; an adapter's name that two models
have is a 400 naming both spellings, one not served a 404; `/v1/models` lists each adapter with its
parent; a model woken from level 2 serves its adapters again."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.hang_guard import HANG_S
from tests.infer.many_models import ManyModelServer, answer_text, expected_text
from tests.infer.running_server import serving_url, stop_serving, terminate_if_running

peft = pytest.importorskip("peft")
PROMPT = "adapters on many models"


@pytest.fixture(scope="module")
def adapters(llama, mixtral, tmp_path_factory):
    """{(model, adapter): (directory, PEFT model)}: two on the Llama, one on the Mixtral named as one
    of the Llama's."""
    from tests.infer.test_lora import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for (model, adapter), (path, family, seed) in {("a", "sql"): (llama[0], "llama", 1),
                                                    ("a", "math"): (llama[0], "llama", 2),
                                                    ("b", "sql"): (mixtral[0], "mixtral", 3)}.items():
        out = root / f"{model}-{adapter}"
        made[(model, adapter)] = (str(out), make_adapter(path, family, out, seed))
    return made


def test_a_request_names_its_model_and_adapter(llama, mixtral, adapters):
    (lpath, lhf), (mpath, mhf) = llama, mixtral
    served = {m: {a: d for (mm, a), (d, _) in adapters.items() if mm == m} for m in ("a", "b")}
    want = {f"{m}:{a}": expected_text(lpath if m == "a" else mpath, hf, PROMPT) for (m, a), (_, hf) in adapters.items()}
    want |= {"a": expected_text(lpath, lhf, PROMPT), "b": expected_text(mpath, mhf, PROMPT)}
    assert len(set(want.values())) == len(want)  # every adapter changes its model's answer
    with ManyModelServer({"a": str(lpath), "b": str(mpath)}, sleep_level=2, adapters=served) as server:
        for name in ("a:sql", "b", "b:sql", "a:math", "a"):  # interleaved over both models
            assert answer_text(server.complete(name, PROMPT)) == want[name], name
        assert answer_text(server.complete("math", PROMPT)) == want["a:math"]  # one model has a "math"
        both = server.complete("sql", PROMPT)
        assert both.status_code == 400 and both.json()["error"]["param"] == "model"
        assert "['a:sql', 'b:sql']" in both.json()["error"]["message"]
        missing = server.complete("b:math", PROMPT)
        assert missing.status_code == 404 and "'a:math'" in missing.json()["error"]["message"]
        listed = {m["id"]: m.get("parent") for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert listed == {"a": None, "b": None, "a:sql": "a", "a:math": "a", "b:sql": "b"}
        r = httpx.post(server.url + "/sleep", params={"level": 2, "model": "a"}, timeout=HANG_S)
        assert r.json()["level"] == 2
        assert answer_text(server.complete("a:sql", PROMPT)) == want["a:sql"]  # woken, its adapters read again


@pytest.mark.slow
def test_the_serve_command_serves_adapters_on_several_models(llama, mixtral, adapters):
    """`tessera serve --model ... --lora MODEL:ADAPTER=DIR ...` as a process."""
    (lpath, _), (mpath, _) = llama, mixtral
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--model", f"a={lpath}", "--model",
                             f"b={mpath}", "--lora", f"a:sql={adapters[('a', 'sql')][0]}", "--lora",
                             f"b:sql={adapters[('b', 'sql')][0]}", "--memory-budget-gib", "1", "--port", "0",
                             "--block-size", "4", "--kv-cache-gib", "0.001", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    try:
        url = serving_url(proc)
        for (model, adapter), path in ((("a", "sql"), lpath), (("b", "sql"), mpath)):
            body = {"model": f"{model}:{adapter}", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
            assert answer_text(r) == expected_text(path, adapters[(model, adapter)][1], PROMPT)
        stop_serving(proc)
    finally:
        terminate_if_running(proc)
