"""What `tessera serve` holds beside the model (issue 53: its resident memory against llama.cpp's
server on the same GGUF file). Loading and serving a model on one rank imports none of torch's
parts that only cutting tensors or compiling needs (torch._dynamo, DTensor, torch's distributed
checkpoints, with sympy under them: about 70 MiB), nor transformers, whose GGUF tokenizer is built in
a child process (another 120 MiB); a HuggingFace directory the same. A GGUF model on the CPU gets an
int8 KV cache by default (a quarter of fp32's bytes, about half of llama.cpp's f16), which
`kv_cache_dtype` (`--kv-cache-dtype dtype` or `int8`) overrides; any other model keeps its cache in
--dtype. The real SmolLM2 file's greedy tokens and perplexity with the int8 cache against the fp32
one: tests/infer/test_gguf_matmul_smollm2.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.infer import LLM, EngineConfig, SamplingParams
from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf
from tests.hang_guard import HANG_S
from tests.infer.tiny_models import write_model

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.checkpoint", "sympy", "transformers")
# the server's modules imported as `tessera serve` imports them, then the engine loaded and stepped
SERVE = """
import json, sys
import tessera.cli.serve, uvicorn
from tessera.infer.api.server import create_app
from tessera.infer import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=2, max_model_len=64, block_size=4)
out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
print(json.dumps({"tokens": len(out[0].token_ids), "loaded": [m for m in sys.argv[2:] if m in sys.modules]}))
"""


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tiny_hf_model("llama", seed=3), tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                      ("Q8_0", "Q4_K", "Q6_K"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    write_model(path, "llama")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_serving_on_one_rank_imports_no_dynamo_dtensor_distributed_checkpoint_or_transformers(kind, request):
    model = request.getfixturevalue("gguf" if kind == "gguf" else "hf_dir")
    run = subprocess.run([sys.executable, "-c", SERVE, str(model), *HEAVY], cwd=ROOT, capture_output=True,
                         text=True, timeout=HANG_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 3
    assert report["loaded"] == [], f"serving a {kind} model imported {report['loaded']}"


def test_a_gguf_model_on_the_cpu_gets_an_int8_kv_cache_unless_told_otherwise(gguf, hf_dir):
    options = {"max_num_seqs": 1, "max_model_len": 32, "block_size": 4}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for path, kv, stored in ((gguf, None, torch.int8), (gguf, "dtype", torch.float32), (gguf, "int8", torch.int8),
                             (hf_dir, None, torch.float32), (hf_dir, "int8", torch.int8)):
        llm = LLM(str(path), kv_cache_dtype=kv, **options)
        try:
            assert llm.engine.kv.k[0].dtype == stored, (path.name, kv)
            assert llm.engine.config.kv_cache_dtype == (kv or ("int8" if path == gguf else None))
            assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4
        finally:
            llm.close()


def test_the_kv_cache_dtype_default_is_settled_by_the_model_and_the_device():
    assert EngineConfig().kv_cache_dtype_for(is_gguf=True) == "int8"
    assert EngineConfig().kv_cache_dtype_for(is_gguf=False) == "dtype"
    assert EngineConfig(kv_cache_dtype="dtype").kv_cache_dtype_for(is_gguf=True) == "dtype"
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype_for(is_gguf=False) == "int8"
    on_gpu = EngineConfig()
    on_gpu.device = "cuda"  # as resolved on a machine with one (the check needs no GPU)
    assert on_gpu.kv_cache_dtype_for(is_gguf=True) == "dtype"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8' is invalid: None, 'int8' or 'dtype'"):
        EngineConfig(kv_cache_dtype="fp8")
