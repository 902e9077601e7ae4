"""A malformed HuggingFace model directory is one line (`tessera <cmd>: error: ...`, exit 1) from
`convert` and `generate`, never a traceback; so is a destination convert cannot write."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tessera
from tessera.cli import main
from tessera.config import get_preset
from tessera.hf import save_pretrained
from tessera.models import Transformer
from tests.checkpoint.unwritable_dirs import run_with_read_only

BUNDLED_TOKENIZER = str(Path(tessera.__file__).parent / "assets" / "tokenizer")  # the model dirs here have none


def _weights(d):
    return d / "model.safetensors"


def _config(d, edit):
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _truncated(d):
    data = _weights(d).read_bytes()
    _weights(d).write_bytes(data[: len(data) // 2])


def _huge_header(d):
    data = _weights(d).read_bytes()
    _weights(d).write_bytes(struct.pack("<Q", 2**62) + data[8:])


def _int64(d):
    save_file({k: v.to(torch.int64) for k, v in load_file(_weights(d)).items()}, _weights(d))


CASES = {
    "truncated safetensors": (_truncated, "not a readable safetensors file"),
    "header length 2^62": (_huge_header, "not a readable safetensors file"),
    "empty safetensors": (lambda d: _weights(d).write_bytes(b""), "not a readable safetensors file"),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{oops"), "config.json' is not valid JSON"),
    "config.json not UTF-8": (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{"), "is not valid JSON"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "holds a JSON list"),
    "config field missing": (lambda d: _config(d, lambda c: c.pop("hidden_size")), "'hidden_size' is missing"),
    "config field mistyped": (lambda d: _config(d, lambda c: c.update(num_hidden_layers="two")),
                              "num_hidden_layers='two' is invalid: must be an integer"),
    "config field a float": (lambda d: _config(d, lambda c: c.update(hidden_size=64.5)), "must be an integer"),
    "rope_scaling mistyped": (lambda d: _config(d, lambda c: c.update(rope_scaling="linear")), "wrong type"),
    "index not JSON": (lambda d: (d / "model.safetensors.index.json").write_text("{"), "index.json' is not valid"),
    "index without weight_map": (lambda d: (d / "model.safetensors.index.json").write_text("{}"), "weight_map"),
    "int64 weights": (_int64, "has dtype int64; model weights must be floating point"),
    "config.json nested 100,000 deep": (lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
                                        "config.json' is nested too deeply to parse"),
    "config.json with a lone surrogate": (lambda d: _config(d, lambda c: c.update(model_type="llama\udc80")),
                                          "$.model_type is not valid Unicode text"),
}


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "model"
    save_pretrained(Transformer(get_preset("tiny-llama"), init_seed=0), path)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_directory_is_one_line(case, good_dir, tmp_path, capsys):
    import shutil

    damage, expected = CASES[case]
    model = tmp_path / "model"
    shutil.copytree(good_dir, model)
    damage(model)
    for command in (["convert", str(model), str(tmp_path / "out")], ["generate", str(model), "--prompt", "x",
                                                                          "--tokenizer", BUNDLED_TOKENIZER]):
        assert main(command) == 1, case
        err = capsys.readouterr().err
        assert err.startswith(f"tessera {command[0]}: error: ") and err.count("\n") == 1, err
        assert expected in err, err
    assert not (tmp_path / "out").exists()


def test_convert_to_a_file_is_one_line(good_dir, tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("keep")
    assert main(["convert", str(good_dir), str(target)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file" in err and target.read_text() == "keep"


def test_convert_to_a_read_only_destination_is_one_line(good_dir, tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    proc = run_with_read_only(read_only, ["convert", str(good_dir), str(read_only / "out")])
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("tessera convert: error: ") and proc.stderr.count("\n") == 1
    assert "cannot be written" in proc.stderr
