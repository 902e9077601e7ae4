"""Weight quantization at load on CUDA (marked `gpu`: skipped where CUDA is absent; CUDA runs only in
spawned children). fp8 linear layers take the FP8 tensor-core path where the GPU has one and stay
close to the reference dequantize-and-multiply; every method generates greedily in bf16."""

from __future__ import annotations

import pytest

from tests.gpu.test_cuda_training import in_spawned_process
from tests.infer.tiny_models import write_model

pytestmark = pytest.mark.gpu


def fp8_layer_on_cuda() -> tuple[bool, bool, float]:
    """Runs in the child: (whether the GPU has FP8 tensor cores, whether the tensor-core path ran,
    its relative error to the reference)."""
    import torch

    from tessera.models.quantized import Fp8Linear, fp8_tensor_cores

    torch.manual_seed(0)
    # Quantized from a bf16 layer already on the GPU, as the engine does (a later .to(dtype) would cast
    # the e4m3 codes too)
    layer = Fp8Linear.from_linear(torch.nn.Linear(256, 128, bias=True).to("cuda", torch.bfloat16))
    x = torch.randn(7, 256, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), layer.qweight.float() * layer.scale.float()[:, None],
                                      layer.bias.float())
    got = layer(x).float()
    has_fp8 = torch.cuda.get_device_capability() >= (8, 9) and torch.version.hip is None
    return has_fp8, fp8_tensor_cores(x, layer), float((got - want).norm() / want.norm())


def greedy_on_cuda(path: str, method: str) -> list[int]:
    from tessera.infer import LLM, SamplingParams

    llm = LLM(path, device="cuda", dtype="bfloat16", block_size=4, quantization=method)
    return llm.generate(["quantized"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids


def test_fp8_layer_on_cuda_is_close_to_the_reference():
    has_fp8, took_path, rel = in_spawned_process(fp8_layer_on_cuda)
    assert took_path == has_fp8
    assert rel < 0.05  # activations cast to e4m3 (3 mantissa bits) on the tensor-core path, bf16 output


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_quantized_greedy_generation_on_cuda(method, tmp_path):
    write_model(tmp_path, "llama", std=0.25)
    assert len(in_spawned_process(greedy_on_cuda, str(tmp_path), method)) == 12
