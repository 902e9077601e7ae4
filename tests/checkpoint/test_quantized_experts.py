"""Routed experts stored quantized (tessera/models/stored_quant_experts.py, loaded by
tessera/checkpoint/prequantized): DeepSeek-V3 block FP8 with every expert quantized gives the logits
of transformers' own FP8 loader; compressed-tensors experts (W4A16 / W8A16 group-wise, FP8 per
channel) give the logits of transformers over the compressed-tensors library's decompressed weights,
and W8A8 / FP8 with dynamic activations the library's own quantized modules' products; the codes stay
in their stored dtype in memory; a layer whose experts are only partly quantized, and expert
parallelism over quantized experts, are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.checkpoint.loading import load_model
from tessera.config.errors import ConfigError, ParallelError
from tessera.infer import LLM, SamplingParams
from tessera.models.stored_quant import BlockFp8Linear
from tessera.models.stored_quant_experts import PROJECTIONS, StoredQuantExperts
from tests.checkpoint.quantized_moe_checkpoints import write_block_fp8_moe, write_compressed_moe
from tests.checkpoint.test_compressed_tensors import KINDS as DENSE_KINDS
from tests.forked_ranks import run_ranks
from tests.infer.tiny_models import VOCAB, hf_greedy

IDS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(4))
# kind -> (per-expert layer class, its code buffer, the code dtype, bits per weight): the dense test's
# rows for the schemes written on experts here
KINDS = {kind: DENSE_KINDS[kind] for kind in
         ("w4a16", "w4a16_asym", "w8a16", "fp8_weight_only", "w8a8_dynamic", "fp8_channel_dynamic")}
WEIGHT_ONLY = ("w4a16", "w4a16_asym", "w8a16", "fp8_weight_only")


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def quantized_experts(model) -> dict[str, StoredQuantExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, StoredQuantExperts)}


def check_kept_quantized(experts: StoredQuantExperts, layer_cls: type, code: str, code_dtype: torch.dtype,
                         bits: int) -> None:
    """Every expert's projections are `layer_cls` whose codes take `bits` per weight, and the layer's
    other tensors are scales (at most one per 16 weights), not a full-precision copy."""
    for p in PROJECTIONS:
        for layer in getattr(experts, p):
            codes = getattr(layer, code)
            assert type(layer) is layer_cls and codes.dtype == code_dtype
            weights = layer.out_features * layer.in_features
            assert codes.numel() * codes.element_size() == weights * bits // 8
            others = [t for n, t in layer.state_dict().items() if n != code]
            assert others and all(16 * t.numel() <= weights for t in others)


def test_deepseek_v3_block_fp8_experts_equal_transformers_fp8_loading(tmp_path):
    """Every block linear quantized (MLA projections, the dense MLP, shared and routed experts; the
    router not), in 4 x 4 blocks that divide every weight, as transformers' FineGrainedFP8 loader
    (dequantize=True, on CPU) reads them; then greedy serving gives transformers' tokens."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    full = write_block_fp8_moe(tmp_path, "deepseek_v3", (4, 4))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=FineGrainedFP8Config(
        dequantize=True), dtype=torch.float32).eval()
    loaded = load_model(tmp_path)
    experts = quantized_experts(loaded.model)
    assert list(experts) == ["layers.1.moe.experts"] and "layers.1.moe.experts" in loaded.quantized
    check_kept_quantized(experts["layers.1.moe.experts"], BlockFp8Linear, "weight", torch.float8_e4m3fn, 8)
    got = logits(loaded.model)
    torch.testing.assert_close(got, logits(reference), rtol=1e-5, atol=1e-5)
    assert (got - logits(full)).abs().max() > 1e-4  # the quantization is there to see
    llm = LLM(str(tmp_path), block_size=4, num_blocks=64)
    prompt = IDS[0, :7].tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(reference, prompt, 8)


@pytest.mark.parametrize("kind", WEIGHT_ONLY)
def test_compressed_tensors_experts_equal_the_librarys_decompression(kind, tmp_path):
    """A Qwen3-MoE whose attention and routed experts the library quantized (router ignored): the
    logits of transformers over the library's decompressed weights."""
    from transformers import AutoModelForCausalLM

    _, reference_dir = write_compressed_moe(tmp_path / "q", kind)
    loaded = load_model(tmp_path / "q")
    experts = quantized_experts(loaded.model)
    assert sorted(experts) == ["layers.0.moe.experts", "layers.1.moe.experts"]
    for m in experts.values():
        check_kept_quantized(m, *KINDS[kind])
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(loaded.model), logits(reference), rtol=1e-5, atol=1e-5)
    assert loaded.model.layers["0"].moe.router.weight.dtype == torch.float32


@pytest.mark.parametrize("kind", ["w8a8_dynamic", "fp8_channel_dynamic"])
def test_activation_quantized_experts_equal_the_librarys_modules(kind, tmp_path):
    """W8A8 and FP8 with dynamic per-token activations on the experts: the MoE layer's output is
    sum_k g_k * down(silu(gate(x)) * up(x)) computed by the library's own quantized modules (which
    quantize each input per token) of the experts the router chose."""
    tree, _ = write_compressed_moe(tmp_path / "q", kind)
    loaded = load_model(tmp_path / "q")
    moe = loaded.model.layers["1"].moe
    check_kept_quantized(moe.experts, *KINDS[kind])
    x = torch.randn(1, 6, loaded.model.cfg.dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, route = moe(x)
        want = torch.zeros_like(x[0])
        for t in range(x.shape[1]):
            for e, g in zip(route.indices_Tk[t].tolist(), route.weights_Tk[t], strict=True):
                expert = tree.get_submodule(f"model.layers.1.mlp.experts.{e}")
                h = F.silu(expert.gate_proj(x[:, t])) * expert.up_proj(x[:, t])
                want[t] += g * expert.down_proj(h)[0]
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_experts_stored_partly_quantized_are_refused_by_name(tmp_path):
    write_block_fp8_moe(tmp_path, "mixtral", (16, 16), quantize=lambda k: ".experts.0." in k)
    with pytest.raises(ConfigError, match="layers.0.moe.experts has routed experts stored partly quantized "
                                          "\\(model.layers.0.block_sparse_moe.experts.0.w1 quantized, "
                                          "model.layers.0.block_sparse_moe.experts.1.w1 not\\)"):
        load_model(tmp_path)


def _expert_parallel(path: str) -> str:
    from tessera.config.parallel import ParallelConfig
    from tessera.parallel import ParallelDims
    from tessera.parallel.expert_parallel import apply_expert_parallel

    model = load_model(path).model
    dims = ParallelDims.from_config(ParallelConfig(ep=2), 2)
    dims.build_mesh()
    try:
        apply_expert_parallel(model, dims)
    except ParallelError as e:
        return str(e)
    return "applied"


@pytest.mark.dist
def test_expert_parallelism_refuses_quantized_experts_by_name(tmp_path):
    write_block_fp8_moe(tmp_path, "mixtral", (16, 16))
    got = run_ranks(_expert_parallel, 2, str(tmp_path))
    assert got == ["routed experts stored quantized (StoredQuantExperts) are not split over ep: expert parallelism "
                   "splits full-precision expert parameters; run quantized experts with ep=1 and tp=1"] * 2
