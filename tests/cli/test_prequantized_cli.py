"""`tessera generate DIR`, `tessera serve DIR` and `tessera convert DIR` on pre-quantized
HuggingFace directories (compressed-tensors written by the compressed-tensors library): the same
greedy text as the library's decompressed model, a real server answering, and exit status 2 in one
line for a quantization Tessera does not run or a conversion that needs full-precision weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tessera.cli import main
from tessera.data.tokenizer import load_tokenizer
from tests.checkpoint.quantized_checkpoints import write_compressed
from tests.hang_guard import HANG_S
from tests.infer.running_server import free_port, stop_serving, terminate_if_running, wait_until_serving
from tests.infer.tiny_models import hf_greedy

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def main():\n    return"


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    path = tmp_path_factory.mktemp("ct") / "w4a16"
    return path, write_compressed(path, "w4a16_asym", seed=4)


def expected_text(path: Path, reference, n: int, stop_at_eos: bool) -> str:
    tok = load_tokenizer(str(path))
    ids = hf_greedy(reference, tok.encode(PROMPT, add_special_tokens=False), n)
    if stop_at_eos and tok.eos_id in ids:
        ids = ids[:ids.index(tok.eos_id)]
    return tok.decode(ids, skip_special_tokens=True)


def test_generate_from_a_compressed_tensors_directory(w4a16, capsys):
    path, reference = w4a16
    assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == PROMPT + expected_text(path, reference, 6, stop_at_eos=True) + "\n"


def test_unsupported_quantization_and_conversion_exit_2_in_one_line(w4a16, tmp_path, capsys):
    path, _ = w4a16
    assert main(["convert", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is pre-quantized (quantization_config.quant_method='compressed-tensors')" in err
    assert not (tmp_path / "out").exists()
    foreign = tmp_path / "gptq"
    foreign.mkdir()
    for f in path.iterdir():
        (foreign / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (foreign / "config.json").write_text(json.dumps(cfg))
    assert main(["serve", str(foreign), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "quant_method='gptq' is not supported" in err and "'compressed-tensors'" in err


@pytest.mark.slow
def test_serve_a_compressed_tensors_directory_over_http(w4a16):
    path, reference = w4a16
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(path), "--port", str(port),
                             "--block-size", "4", "--max-model-len", "64", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url)
        [model] = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected_text(path, reference, 6, stop_at_eos=False)
        stop_serving(proc)
    finally:
        terminate_if_running(proc)
