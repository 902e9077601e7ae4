"""A destination that fills up or cannot be written is one line (exit 1), and nothing partial is left
there, from every command that writes files: convert (both ways) and preprocess (text and SFT).
Training's own saves are covered in test_checksums.py and test_run_lock.py."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config import get_preset
from tessera.hf import save_pretrained
from tessera.models import Transformer
from tests.checkpoint.unwritable_dirs import run_with_full_disk, run_with_read_only


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A HuggingFace directory (~0.4 MB of weights), the same model as a Tessera checkpoint, and
    ~0.5 MB of text and conversations: each more than the 64 KiB the full disk holds."""
    root = tmp_path_factory.mktemp("sources")
    save_pretrained(Transformer(get_preset("tiny-llama", vocab_size=4096), init_seed=0), root / "hf",
                    tokenizer="default")
    assert main(["convert", str(root / "hf"), str(root / "tessera")]) == 0
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(40)))
    chat = [{"role": "user", "content": text[:2000]}, {"role": "assistant", "content": text[2000:4000]}]
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(100)))
    return root


def _one_line(proc, command: str) -> str:
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and last.startswith(f"tessera {command}: error: "), proc.stderr[-3000:]
    return last


@pytest.mark.parametrize("argv, written", [
    (["convert", "{tessera}", "{out}/hf"], "hf"),
    (["convert", "{hf}", "{out}/ckpt"], "ckpt"),
    (["preprocess", "{docs}", "--output", "{out}/text"], "text"),
    (["preprocess", "{chats}", "--sft", "--output", "{out}/sft", "--tokenizer", "{hf}"], "sft"),
], ids=["export to HF", "HF to Tessera", "preprocess", "preprocess --sft"])
def test_a_full_disk_is_one_line_and_leaves_nothing(sources, tmp_path, argv, written):
    out = tmp_path / "full"
    out.mkdir()
    paths = {"tessera": sources / "tessera", "hf": sources / "hf", "docs": sources / "docs.jsonl",
             "chats": sources / "chats.jsonl", "out": out}
    proc, left = run_with_full_disk(out, [a.format(**paths) for a in argv])
    last = _one_line(proc, argv[0])
    assert "No space left on device" in last, last
    assert left == [], left  # on the full file system, when the command had ended


@pytest.mark.parametrize("sft", [False, True], ids=["text", "sft"])
def test_preprocess_to_a_read_only_directory_is_one_line(sources, tmp_path, sft):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    argv = ["preprocess", str(sources / ("chats.jsonl" if sft else "docs.jsonl")), "--output", str(read_only / "ds")]
    proc = run_with_read_only(read_only, argv + (["--sft", "--tokenizer", str(sources / "hf")] if sft else []))
    last = _one_line(proc, "preprocess")
    assert "cannot be written" in last and "nothing was written there" in last, last
