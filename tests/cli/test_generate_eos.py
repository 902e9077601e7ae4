"""`tessera generate` reads a model directory's end-of-sequence ids as serving does (config.json's,
generation_config.json's and the tokenizer's eos_token_id): one outside the vocabulary is refused in
one line naming the file, the field and the vocabulary (it was taken silently, a stop rule that could
never fire), and generation stops at generation_config.json's ids too."""

from __future__ import annotations

import json
import shutil

import pytest

from tessera.cli import main
from tessera.data.tokenizer import Tokenizer
from tests.infer.tiny_models import write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "hf"
    write_model(path, "llama", std=0.25, max_position_embeddings=64)
    return path


def _edited(model, tmp_path, name, eos):
    path = tmp_path / "edited"
    shutil.copytree(model, path)
    cfg = json.loads((path / name).read_text())
    (path / name).write_text(json.dumps({**cfg, "eos_token_id": eos}))
    return path


@pytest.mark.parametrize("name, eos", [("config.json", 10**9), ("generation_config.json", [1, 10**9]),
                                       ("config.json", -1), ("generation_config.json", "1")])
def test_an_eos_token_id_outside_the_vocabulary_is_refused_in_one_line(model, tmp_path, capsys, name, eos):
    path = _edited(model, tmp_path, name, eos)
    assert main(["generate", str(path), "--prompt", "ab", "--max-new-tokens", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera generate: error: ") and "\n" not in err, err
    assert f"{name}': eos_token_id={eos!r} is invalid" in err and "vocabulary (0..127)" in err


def test_generation_stops_at_the_generation_configs_eos_ids(model, tmp_path, capsys):
    prompt = "generate me"
    assert main(["generate", str(model), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    full = capsys.readouterr().out.removeprefix(prompt).removesuffix("\n")
    assert len(full) >= 3, full  # the character tokenizer: one character a token
    stop = full.index(full[2])  # the third character, where it first comes
    [token] = Tokenizer.from_path(model).encode(full[stop], add_special_tokens=False)
    assert main(["generate", str(_edited(model, tmp_path, "generation_config.json", [1, token])), "--prompt",
                 prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == prompt + full[:stop + 1] + "\n"  # the stop token is the last one
