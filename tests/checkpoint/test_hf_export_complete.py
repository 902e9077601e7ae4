"""A HuggingFace export of a trained run is complete: transformers loads the model and its
tokenizer from the directory alone, the special-token ids and the chat template travel with it,
the files are readable by others as the umask allows, and `tessera serve` answers text on it.
A directory without a tokenizer is refused at start-up, by `serve` and by `generate`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tessera.checkpoint.convert import convert
from tessera.config.schema import load_config
from tessera.data.tokenizer import default_tokenizer
from tessera.train.trainer import Trainer
from tests.hang_guard import HANG_S
from tests.infer.running_server import free_port, wait_until_serving
from tests.train.runs import ROOT, TINY_DENSE, shrink


@pytest.fixture(scope="module")
def export(small_dataset, tmp_path_factory) -> Path:
    """A 2-step run of the shrunken tiny dense model, converted to HuggingFace under umask 022."""
    base = tmp_path_factory.mktemp("export")
    Trainer(load_config(TINY_DENSE, shrink(small_dataset, base / "run", 2))).train()
    old = os.umask(0o022)
    try:
        convert(base / "run", base / "hf")
    finally:
        os.umask(old)
    return base / "hf"


def test_transformers_loads_model_and_tokenizer(export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bundled = default_tokenizer()
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == bundled.eos_id
    assert tok.pad_token_id == bundled.pad_id
    assert tok("def main(")["input_ids"] == bundled.encode("def main(")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == bundled.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.eos_token_id == bundled.eos_id and model.config.pad_token_id == bundled.pad_id
    assert model.config.bos_token_id is None  # the bundled tokenizer has no BOS token
    assert model.generation_config.eos_token_id == bundled.eos_id
    ids = torch.tensor([bundled.encode("def main(")])
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_special_token_ids_are_written_in_both_configs(export):
    bundled = default_tokenizer()
    for name in ("config.json", "generation_config.json"):
        config = json.loads((export / name).read_text())
        assert config["eos_token_id"] == bundled.eos_id, name
        assert config["pad_token_id"] == bundled.pad_id, name


def test_exported_files_respect_the_umask(export):
    assert stat.S_IMODE(export.stat().st_mode) == 0o755
    names = sorted(p.name for p in export.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    for f in export.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


def _serve(model_dir: Path, port: int) -> subprocess.Popen:
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(model_dir), "--port", str(port),
                             "--log-level", "warning", "--kv-cache-gib", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


@pytest.mark.slow
def test_serve_answers_a_text_prompt_on_the_export(export):
    port = free_port()
    proc = _serve(export, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url)
        body = {"model": str(export), "prompt": "def main(", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert isinstance(r.json()["choices"][0]["text"], str)
    finally:
        proc.terminate()
        proc.wait(HANG_S)


def _without_tokenizer(export: Path, tmp_path: Path) -> Path:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((export / name).read_bytes())
    return bare


def test_serve_refuses_a_directory_without_tokenizer_at_start_up(export, tmp_path):
    proc = _serve(_without_tokenizer(export, tmp_path), free_port())
    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 1, out
    assert "tessera serve: error: " in out and "has no tokenizer" in out
    assert len([line for line in out.splitlines() if line.strip()]) == 1, out


def test_generate_refuses_a_directory_without_tokenizer(export, tmp_path):
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tessera", "generate", str(_without_tokenizer(export, tmp_path)),
                           "--prompt", "def "], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("tessera generate: error: ") and "has no tokenizer" in proc.stderr


def test_converting_an_export_back_records_its_tokenizer(export, tmp_path):
    from tessera.checkpoint.loading import load_model, trained_tokenizer

    convert(export, tmp_path / "back")
    assert load_model(tmp_path / "back").run_config["data"]["tokenizer"] == str(export.resolve())
    assert trained_tokenizer(tmp_path / "back") == str(export.resolve())
