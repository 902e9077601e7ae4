"""GGUF files (llama.cpp's format) load as the model transformers' own GGUF loader gives: the same
logits (the same dequantized weights, llama.cpp's query/key row order undone), the same greedy
tokens and the same tokenizer; bad files are one ConfigError naming what is wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tessera.checkpoint.gguf import TENSOR_TYPES, GGUFFile, load_gguf
from tessera.checkpoint.loading import load_model, model_tokenizer
from tessera.config.errors import ConfigError
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.models.int8 import Int8Linear
from tests.checkpoint.gguf_files import LLAMA_LIKE, QUANTIZABLE, hf_from_gguf, tiny_hf_model, write_gguf
from tests.infer.tiny_models import hf_greedy

PROMPT = "def main():\n    return"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """arch -> (a GGUF file holding every supported tensor type, transformers' model of it)."""
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch in LLAMA_LIKE:
        path = write_gguf(tiny_hf_model(arch), root / f"tiny-{arch}.gguf", TENSOR_TYPES)
        files[arch] = (path, hf_from_gguf(path))
    return files


@pytest.fixture(scope="module")
def q8_llama(tmp_path_factory):
    """A LLaMA GGUF of the model's own weights in Q8_0 (sensible text, unlike random K-quant blocks)."""
    path = write_gguf(tiny_hf_model("llama", seed=1), tmp_path_factory.mktemp("q8") / "tiny-q8.gguf", ("Q8_0",))
    return path, hf_from_gguf(path)


@pytest.mark.parametrize("arch", list(LLAMA_LIKE))
def test_every_tensor_type_gives_transformers_logits(arch, gguf_files):
    path, hf = gguf_files[arch]
    stored = {t.tensor_type.name for t in GGUFFile.open(path).reader.tensors}
    assert stored == set(TENSOR_TYPES)  # the file holds every type Tessera reads
    model = load_gguf(path)
    ids = torch.randint(0, 4096, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
    assert model.cfg.family == arch and model.cfg.tie_embeddings == (arch == "llama")


def test_quantizable_types_stay_close_to_the_unquantized_model(tmp_path):
    """Dequantized weights are the original ones up to the format's rounding: the row permutation
    is undone (a wrong order would change the logits completely)."""
    hf = tiny_hf_model("llama")
    path = write_gguf(hf, tmp_path / "f16.gguf", ("F16",))
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(load_gguf(path)(ids).logits, hf(ids).logits, rtol=0, atol=5e-3)
    assert set(QUANTIZABLE) < set(TENSOR_TYPES)


def test_greedy_generation_and_tokenizer_equal_transformers(q8_llama):
    from transformers import AutoTokenizer

    path, hf = q8_llama
    tokenizer = model_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tokenizer.encode(PROMPT) == reference.encode(PROMPT)
    assert tokenizer.eos_id == reference.eos_token_id == 0
    loaded = load_model(path)
    assert loaded.quantized is None and loaded.run_config is None
    ids = tokenizer.encode(PROMPT)
    llm = LLM(loaded.model, tokenizer=tokenizer, max_num_seqs=1, max_model_len=64)
    got = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == hf_greedy(hf, ids, 12)


def test_int8_at_load_applies_on_top_of_gguf(q8_llama, tmp_path):
    """`--quantization int8` quantizes the dequantized weights, as it would the same weights from a
    HuggingFace directory: the same int8 layers, the same greedy tokens."""
    from tessera.checkpoint.convert import convert

    path, _ = q8_llama
    convert(path, tmp_path / "hf")
    config = EngineConfig(quantization="int8", num_blocks=16, block_size=4, max_model_len=64)
    outputs = []
    for source in (path, tmp_path / "hf"):
        engine = LLMEngine.from_dir(source, config)
        assert any(isinstance(m, Int8Linear) for m in engine.model.modules())
        ids = engine.tokenizer.encode(PROMPT)
        engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            outputs += [o.token_ids for o in engine.step() if o.finished]
        engine.close()
    assert len(outputs) == 2 and outputs[0] == outputs[1]


def _damaged(tmp_path: Path, source: Path, keep: int) -> Path:
    bad = tmp_path / f"cut-{keep}.gguf"
    bad.write_bytes(source.read_bytes()[:keep])
    return bad


def test_bad_files_are_config_errors_naming_the_problem(tmp_path, q8_llama):
    path, _ = q8_llama
    size = path.stat().st_size
    (tmp_path / "text.gguf").write_text("not a model\n")
    (tmp_path / "dir.gguf").mkdir()
    cases = {
        tmp_path / "text.gguf": "is not a GGUF file",
        tmp_path / "dir.gguf": "is a directory",
        tmp_path / "missing.gguf": "does not exist",
        _damaged(tmp_path, path, 64): "truncated or damaged",
        _damaged(tmp_path, path, size - 1000): "truncated or damaged",
    }
    for bad, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_model(bad) if bad.suffix == ".gguf" and not bad.is_dir() else GGUFFile.open(bad)
    renamed = tmp_path / "model.bin"  # a GGUF file is one by its first bytes, whatever its name
    renamed.write_bytes(path.read_bytes())
    assert load_model(renamed).model.cfg.family == "llama"


def test_unknown_architecture_and_tensor_type_are_refused_by_name(tmp_path):
    import gguf

    hf = tiny_hf_model("llama")
    with pytest.raises(ConfigError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2"):
        load_gguf(write_gguf(hf, tmp_path / "gpt2.gguf", ("F32",), arch="gpt2"))
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(8, 18 * 8, dtype=torch.uint8).numpy(),
                      raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"type IQ4_NL, which Tessera does not read; supported: F32, F16"):
        load_gguf(tmp_path / "iq.gguf")


def test_metadata_that_does_not_fit_the_weights_is_refused_by_name(tmp_path):
    """A head count of 0, a head count that cannot split the query rows, and a Llama 3 RoPE frequency
    tensor in an architecture without one (Qwen2): each a ConfigError naming it, never an arithmetic error."""
    import numpy as np

    hf = tiny_hf_model("llama")
    with pytest.raises(ConfigError, match=r"metadata for num_attention_heads is 0; Tessera reads one positive"):
        load_gguf(write_gguf(hf, tmp_path / "zero.gguf", ("F32",), head_count=0))
    with pytest.raises(ConfigError, match="head"):
        load_gguf(write_gguf(hf, tmp_path / "three.gguf", ("F32",), head_count=3))
    qwen2 = tiny_hf_model("qwen2")
    rope = write_gguf(qwen2, tmp_path / "rope.gguf", ("F32",), extra={"rope_freqs.weight": np.ones(32)})
    with pytest.raises(ConfigError, match="'rope_freqs' holds Llama 3-style RoPE frequency scaling, which a qwen2"):
        load_gguf(rope)


def test_a_missing_gguf_package_is_named(q8_llama, monkeypatch):
    path, _ = q8_llama
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ConfigError, match="needs the gguf package: pip install gguf"):
        load_gguf(path)


def test_a_missing_transformers_package_is_named_for_the_tokenizer(q8_llama, monkeypatch):
    from tessera.checkpoint.gguf import gguf_tokenizer

    path, _ = q8_llama
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match="tokenizer needs the transformers package: pip install transformers"):
        gguf_tokenizer(path)
