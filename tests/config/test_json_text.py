"""JSON and text are checked where they enter: nesting too deep to parse and lone surrogates (no
Unicode character: `"\\ud800"` in JSON, undecodable bytes in argv) are one typed error naming the
source and where, never a RecursionError or a tokenizer's TypeError deeper down."""

from __future__ import annotations

import pytest

from tessera.config.errors import ConfigError, DataError
from tessera.config.json_text import check_text, parse_json
from tessera.config.yaml_text import load_yaml

DEEP = "[" * 100_000 + "]" * 100_000


def test_a_document_too_deep_to_parse_is_an_error_naming_it():
    with pytest.raises(DataError, match=r"^notes\.jsonl:3 is nested too deeply to parse"):
        parse_json(DEEP, "notes.jsonl:3", DataError)
    assert parse_json("[" * 50 + "]" * 50, "x", DataError) is not None  # ordinary nesting parses


@pytest.mark.parametrize("document, where", [
    ('{"prompt": "ok \\ud800"}', r"\$\.prompt"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}]}', r"\$\.messages\[0\]\.content"),
    ('{"\\ud800": 1}', r"a key in \$"),
    ('["a", ["b", "\\ud83d"]]', r"\$\[1\]\[1\]"),
])
def test_a_lone_surrogate_is_refused_naming_where_it_is(document, where):
    with pytest.raises(ConfigError, match=rf"^body: {where} is not valid Unicode text: character \d+ is a lone "):
        parse_json(document, "body", ConfigError)


def test_real_text_passes_whole():
    text = '{"a": "naïve café ✓ 日本語 \\ud83d\\ude00", "b": [1, 2.5, null, true]}'  # a surrogate *pair* is 😀
    assert parse_json(text, "x", ConfigError) == {"a": "naïve café ✓ 日本語 😀", "b": [1, 2.5, None, True]}
    assert check_text("😀", "x", ConfigError) == "😀"
    with pytest.raises(ConfigError, match="is not valid JSON"):
        parse_json(b"\xff\xfe{}", "x", ConfigError)


def test_a_lone_surrogate_in_a_yaml_config_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^run\.yaml: \$\.run_dir is not valid Unicode text"):
        load_yaml('run_dir: "runs/\\ud800"\n', "run.yaml")
