"""A chat template is code from a model or tokenizer directory: its rendering is bounded in time,
output and sizes (tessera/data/chat_template.py), and a template past a bound is a DataError naming
it, as fast as the bound allows, while real templates render as before."""

from __future__ import annotations

import json
import time

import pytest

from tessera.cli import main
from tessera.config.errors import DataError
from tessera.data import chat_template
from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE, render_chat_template

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
FOREVER = "{% for a in range(60000) %}{% for b in range(60000) %}{% endfor %}{% endfor %}"  # 3.6e9 rounds


@pytest.fixture
def short_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_SECONDS", 0.5)


def test_a_template_that_would_run_for_hours_stops_at_the_time_limit(short_limit):
    start = time.monotonic()
    with pytest.raises(DataError, match=r"chat template ran longer than a chat template may \(0\.5 s\)"):
        render_chat_template(FOREVER, CHAT)
    assert time.monotonic() - start < 300  # a hang guard: the limit stopped it, not the test's patience


@pytest.mark.parametrize("template, bound", [
    ("{{ 'x' * 10**12 }}", "longer than a chat template may"),
    ("{{ ('x' * 16000000) * 16000000 }}", "longer than a chat template may"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "longer than a chat template may"),
    ("{% set ns = namespace(x=10) %}{% for i in range(60) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "bits"),
    ("{{ 3 ** 100000 }}", "bits"),
    ("{{ 'x' | center(10**12) }}", "uses the number 1000000000000"),
    ("{{ 'x'.ljust(10**12) }}", "uses the number 1000000000000"),
    ("{{ '%999999999999s' % 'x' }}", "formats with a width"),
    ("{{ '{:>999999999999}'.format('x') }}", "formats with a width"),
])
def test_sizes_past_the_bounds_are_refused_before_they_are_allocated(template, bound):
    with pytest.raises(DataError, match=bound):
        render_chat_template(template, CHAT)


def test_output_is_counted_as_it_is_produced(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_CHARS", 1000)
    with pytest.raises(DataError, match=r"rendered more than a chat template may \(1,000 characters\)"):
        render_chat_template("{% for i in range(1000) %}{{ message }}0123456789{% endfor %}", CHAT)
    assert len(render_chat_template(PLAIN_CHAT_TEMPLATE, CHAT)) < 1000


def test_recursion_in_a_template_is_a_data_error():
    with pytest.raises(DataError, match="RecursionError"):
        render_chat_template("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", CHAT)


def test_real_templates_render_as_before():
    llama3 = ("{% for m in messages %}{% set content = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
              "m['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
              "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
    out = render_chat_template(llama3, CHAT, add_generation_prompt=True, special_tokens={"bos_token": "<s>"})
    assert out == ("<s><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant"
                   "<|end_header_id|>\n\nhello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render_chat_template("{{ '%5s|%-4d' % ('a', 7) }}{{ 'x' * 3 }}{{ 2 ** 10 }}", CHAT) == "    a|7   xxx1024"


def test_preprocess_sft_with_a_runaway_template_is_one_line(tmp_path, short_limit, capsys):
    from tessera.data import default_tokenizer

    tok_dir = tmp_path / "tokenizer"
    default_tokenizer().save(tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": FOREVER}))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": CHAT}) + "\n")
    assert main(["preprocess", str(chats), "--sft", "--output", str(tmp_path / "out"), "--tokenizer",
                 str(tok_dir)]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("tessera preprocess: error: ") and "ran longer" in last, err
    assert not [p for p in tmp_path.iterdir() if "out" in p.name]  # nothing partial
