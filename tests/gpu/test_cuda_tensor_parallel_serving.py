"""Tensor-parallel serving on GPUs (marked `gpu`; skipped without CUDA or with fewer than 2 GPUs):
`LLM(..., tensor_parallel_size=2, device="cuda")` runs rank r on cuda:r with NCCL collectives, and
its greedy output equals transformers on the CPU (fp32) for a dense and an MoE model, as the gloo
runs of tests/infer/test_tensor_parallel_serving.py do. CUDA runs only in spawned children."""

from __future__ import annotations

import pytest

from tests.gpu.test_cuda_training import in_spawned_process
from tests.infer.tiny_models import hf_greedy, write_model

pytestmark = pytest.mark.gpu
PROMPTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog", "def f(x):\n    return x\n"]
NEW_TOKENS = 16


def gpu_count() -> int:
    """Runs in the child."""
    import torch

    return torch.cuda.device_count()


def generate_on_two_gpus(path: str) -> tuple[list[list[int]], str]:
    """Runs in the child: greedy token ids per prompt at tensor_parallel_size=2, and the backend
    of the process group the workers were driven through."""
    import torch.distributed as dist

    from tessera.infer import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(path, device="cuda", tensor_parallel_size=2, block_size=4, max_num_batched_tokens=32) as llm:
        out = [o.token_ids for o in llm.generate(PROMPTS, params)]
        return out, dist.get_backend()


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_two_gpus_with_nccl_match_hf(tmp_path, family):
    if in_spawned_process(gpu_count) < 2:
        pytest.skip("needs 2 GPUs")
    hf = write_model(tmp_path, family, std=0.25)
    from tessera.data.tokenizer import Tokenizer

    tok = Tokenizer.from_path(tmp_path)
    want = [hf_greedy(hf, tok.encode(p), NEW_TOKENS) for p in PROMPTS]
    got, backend = in_spawned_process(generate_on_two_gpus, str(tmp_path))
    assert backend == "nccl"
    assert got == want
