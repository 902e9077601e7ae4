"""The vision-language worked example of docs/models.md (the README points to it) runs as written,
in order, in a fresh copy of configs/ and examples/: `tessera train configs/tiny-llava.yaml`
fine-tunes the tiny LLaVA on the bundled shapes, `tessera convert` writes the run as a LLaVA
directory, `tessera serve` serves it on 127.0.0.1 and the `curl` (run by bash, as a user would)
sends a bundled PNG as a data: URL. The export loads in transformers with logits equal to
Tessera's, and the one checkpoint.export_hf wrote is the same files. The example's only change:
port 8000 becomes a free port (and 40 steps become 6, to keep the test cheap)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import torch

from tessera.checkpoint.hf.llava import load_llava
from tessera.cli import main
from tessera.data.image_processor import ImageProcessor, decode_image
from tests.hang_guard import HANG_S
from tests.infer.running_server import free_port, wait_until_serving
from tests.train.runs import ROOT

TESSERA = ".venv/bin/tessera"
HEADING = "#### Fine-tune a vision-language model on image-text conversations"


def example_commands() -> list[str]:
    """The `$ ` commands of the first ```console block after the example's heading."""
    text = (ROOT / "docs/models.md").read_text()
    section = text[text.index(HEADING):]
    block = re.search(r"```console\n(.*?)```", section, re.S).group(1)
    return [line[2:] for line in block.splitlines() if line.startswith("$ ")]


def test_the_readme_vision_language_example_runs_as_written(tmp_path, monkeypatch, capsys):
    commands = example_commands()
    runners = [shlex.split(c, comments=True)[:2] for c in commands]
    assert runners == [[TESSERA, "train"], [TESSERA, "convert"], [TESSERA, "serve"], ["curl", "-s"]]
    work = tmp_path / "checkout"
    for folder in ("configs", "examples"):
        shutil.copytree(ROOT / folder, work / folder)
    monkeypatch.chdir(work)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = free_port()
    server = None
    try:
        for command in commands:
            command = command.replace("8000", str(port))
            words = shlex.split(command, comments=True)
            if words[0] == "curl":  # bash runs it: the guide's $(base64 ...) is part of the example
                wait_until_serving(server, f"http://127.0.0.1:{port}", timeout=HANG_S)
                out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=HANG_S, env=env)
                assert out.returncode == 0, out.stderr
                answer = json.loads(out.stdout)
                assert answer["usage"]["completion_tokens"] == 8, answer
                # the prompt holds the image's 16 tokens: it reached the model as an image
                assert answer["usage"]["prompt_tokens"] > 16 and answer["choices"][0]["message"]["role"] == "assistant"
                continue
            args = words[1:]
            if args[-1] == "&":
                server = subprocess.Popen([sys.executable, "-m", "tessera", *args[:-1], "--port", str(port),
                                           "--log-level", "warning"], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=env)
                continue
            if args[0] == "train":
                args += ["--set", "train.steps=6", "--set", "log.progress_bar=false"]
            status = main(args)
            assert status == 0, capsys.readouterr().err[-3000:]
            if args[0] == "train":  # it says where its export went, and next steps for an image model
                out = capsys.readouterr().out
                assert re.search(r"^exported: \S*runs/tiny-llava/hf$", out, re.M), out
                assert "image_url" in out and "tessera generate" not in out, out
    finally:
        if server is not None:
            server.terminate()
            server.wait(HANG_S)
    metrics = [json.loads(line) for line in (work / "runs/tiny-llava/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "loss" in r][-1] == 6
    converted, exported = work / "runs/tiny-llava-hf", work / "runs/tiny-llava/hf"
    assert (converted / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()
    _equals_transformers(converted, work / "examples/data/shapes/red_circle.png")


def _equals_transformers(path, image_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_llava(path)
    image = decode_image(image_path.read_bytes())
    pixels = torch.from_numpy(np.stack([ImageProcessor.from_directory(path)(image)]))
    assert torch.equal(pixels, AutoImageProcessor.from_pretrained(path)(image, return_tensors="pt")["pixel_values"])
    token = ours.cfg.image_token_id
    ids = torch.tensor([[3, 7] + [token] * ours.cfg.image_tokens + [100, 200, 4]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, pixel_values=pixels).logits, hf(input_ids=ids, pixel_values=pixels).logits,
                                   rtol=1e-4, atol=1e-4)
