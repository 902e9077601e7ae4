"""Weight-only quantization at load (int8, fp8, int4), int8 from a saved pre-quantized directory, and
the int8 KV cache: each layer equal to the reference dequantization of its stored codes and within
the method's rounding bound, the whole model likewise (MLA and experts included), its bytes those of
the format, greedy generation through the engine, logits and perplexity close to full precision."""

import pytest
import torch
from safetensors import safe_open

from tessera.checkpoint.int8 import WEIGHTS_FILE, save_quantized
from tessera.config.errors import ConfigError
from tessera.hf import load_pretrained
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.infer.config import QUANTIZATION_METHODS
from tessera.infer.engine.perplexity import perplexity
from tessera.infer.engine.reference_generation import reference_generate
from tessera.models.int8 import Int8GroupedExperts, Int8Linear, quantize_per_channel
from tessera.models.quantized import LAYERS, Fp8Linear, Int4Linear, quantize_model
from tessera.models.quantized import quantize_model as quantize_by_method
from tests.infer.tiny_models import write_model

HELD_OUT = ("The committee met on Tuesday to review the budget. After a long discussion, members agreed to "
            "postpone the vote until the next meeting, when the final figures would be available.\n") * 2


def test_per_channel_rounding_error_is_at_most_half_a_step():
    w = torch.randn(64, 48) * torch.logspace(-2, 1, 64)[:, None]  # channels of very different scales
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())
    lin = torch.nn.Linear(48, 64, bias=True)
    x = torch.randn(5, 48)
    ql = Int8Linear.from_linear(lin)
    torch.testing.assert_close(ql(x), torch.nn.functional.linear(x, ql.qweight.float() * ql.scale[:, None], lin.bias))


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_int8_model_stays_close_and_saved_copy_matches(family, family_models, tmp_path):
    path, _ = family_models[family]
    model = load_pretrained(path)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = model(ids).logits
        names = quantize_model(model)
        got = model(ids).logits
    kinds = {type(model.get_submodule(n)) for n in names}
    assert Int8Linear in kinds and (family != "mixtral" or Int8GroupedExperts in kinds)
    rel = (got - want).norm() / want.norm()
    assert 0 < rel < 0.1
    save_quantized(model, names, tmp_path / "q", source_dir=path)
    with safe_open(tmp_path / "q" / WEIGHTS_FILE, "pt") as f:
        key = f"{names[0]}.qweight" if "experts" not in names[0] else f"{names[0]}.qw1"
        assert f.get_tensor(key).dtype == torch.int8
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    at_load = LLM(path, block_size=4, quantization="int8").generate(["quantized"], params)
    from_dir = LLM(tmp_path / "q", block_size=4).generate(["quantized"], params)
    assert at_load[0].token_ids == from_dir[0].token_ids
    with pytest.raises(ConfigError, match="quantization='int4' needs full-precision weights.*pre-quantized int8"):
        LLM(tmp_path / "q", block_size=4, quantization="int4")


def test_quantize_command_writes_a_servable_directory(llama, tmp_path):
    from tessera.quantize.int8_directory import main

    assert main([str(llama[0]), str(tmp_path / "q8")]) == 0
    out = LLM(tmp_path / "q8", block_size=4).generate(["x"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) >= 1
    assert isinstance(LLM(tmp_path / "q8", block_size=4).engine.model.layers["0"].attention.wq, Int8Linear)


def test_perplexity_change_of_quantized_weights_and_kv_cache_is_small(llama):
    path, _ = llama
    results = {}
    for name, opts in {"fp32": {}, "w8": {"quantization": "int8"}, "kv8": {"kv_cache_dtype": "int8"},
                       "fp8": {"quantization": "fp8"}, "int4": {"quantization": "int4"}}.items():
        engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, num_blocks=128, **opts))
        results[name] = perplexity(engine, engine.tokenizer.encode(HELD_OUT), chunk=16)
    assert results["fp32"] > 1
    # measured on this random model: +-0.2% (int8 weights, int8 KV), -0.4% (fp8), +9.6% (int4)
    for name, bound in (("w8", 0.05), ("kv8", 0.05), ("fp8", 0.05), ("int4", 0.25)):
        change = abs(results[name] / results["fp32"] - 1)
        assert 0 < change < bound, (name, results)


def test_int8_kv_cache_generates(llama):
    path, hf = llama
    llm = LLM(path, block_size=4, kv_cache_dtype="int8")
    assert llm.engine.kv.k[0].dtype == torch.int8
    out = llm.generate(["some text to continue"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 10


# ---- fp8 and int4 (tessera/models/quantized.py), and every method through the engine and its errors ----

def _channels(out_f: int, in_f: int) -> torch.Tensor:
    """Weights whose output channels (and, for int4, groups) have very different scales."""
    torch.manual_seed(0)
    return torch.randn(out_f, in_f) * torch.logspace(-2, 1, out_f)[:, None] * torch.logspace(0, 1, in_f)[None]


def _fp8_reference(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scale[..., None]


def _int4_reference(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in -7..7 unpacked by hand (column 2j: low nibble, 2j + 1: high nibble) and the dequantized weight."""
    codes = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2)
    codes[..., 0::2] = (packed & 0x0F).float() - 8
    codes[..., 1::2] = (packed >> 4).float() - 8
    group = codes.shape[-1] // scale.shape[-1]
    return codes, codes * scale.repeat_interleave(group, dim=-1)


@pytest.mark.parametrize("in_f, group", [(256, 128), (48, 48)])  # 128 divides in_features, else one group per row
@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_layer_equals_its_reference_dequantization_within_the_rounding_bound(method, in_f, group):
    w = _channels(40, in_f)
    lin = torch.nn.Linear(in_f, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(w)
    ql = (Fp8Linear if method == "fp8" else Int4Linear).from_linear(lin)
    if method == "fp8":
        assert ql.qweight.dtype == torch.float8_e4m3fn and ql.qweight.shape == (40, in_f)
        torch.testing.assert_close(ql.scale, w.abs().amax(1) / 448, rtol=0, atol=0)
        deq = _fp8_reference(ql.qweight, ql.scale)
        # e4m3 has 3 mantissa bits: a normal value is rounded within 2^-4 of itself, a subnormal one
        # (below 2^-6, steps of 2^-9) within 2^-10 of the scale
        bound = torch.maximum(w.abs() * 2**-4, ql.scale[:, None] * 2**-10)
        weight_bytes, scale_bytes = 40 * in_f, 40 * 4
    else:
        assert ql.qweight.dtype == torch.uint8 and ql.qweight.shape == (40, in_f // 2)
        assert ql.scale.shape == (40, in_f // group)
        codes, deq = _int4_reference(ql.qweight, ql.scale)
        assert codes.abs().max() == 7 and bool((codes.abs() <= 7).all())
        bound = ql.scale.repeat_interleave(group, dim=1) / 2  # round-to-nearest: half a step
        weight_bytes, scale_bytes = 40 * in_f // 2, 40 * (in_f // group) * 4
    assert bool(((deq - w).abs() <= bound * (1 + 1e-6)).all())
    x = torch.randn(5, in_f)
    torch.testing.assert_close(ql(x), torch.nn.functional.linear(x, deq, lin.bias), rtol=1e-6, atol=1e-6)
    assert ql.qweight.numel() * ql.qweight.element_size() == weight_bytes  # resident bytes, from the tensors
    assert ql.scale.numel() * ql.scale.element_size() == scale_bytes


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3: MLA attention, a dense first layer, routed and shared experts."""
    path = tmp_path_factory.mktemp("deepseek")
    return path, write_model(path, "deepseek_v3", std=0.25)


# Relative L2 change of a tiny random model's logits (std 0.25 weights, rows of 16 to 48 inputs: one
# int4 group per row); measured 0.02-0.05 (int8), 0.13-0.19 (fp8), 0.47-0.49 (int4).
LOGITS_TOL = {"int8": 0.1, "fp8": 0.3, "int4": 0.7}


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("family", ["llama", "mixtral", "deepseek_v3"])
def test_quantized_model_equals_its_dequantized_reference(family, method, family_models, deepseek):
    """Every block linear (MLA's and the experts' too) is quantized; the model's logits equal those of
    the full-precision model given the reference dequantization of the stored codes, are within
    LOGITS_TOL of the unquantized logits, and the quantized weights take the format's bytes."""
    path = deepseek[0] if family == "deepseek_v3" else family_models[family][0]
    model, reference = load_pretrained(path), load_pretrained(path)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = model(ids).logits
        names = quantize_by_method(model, method)
        got = model(ids).logits
    linear, experts = LAYERS[method]
    kinds = {type(model.get_submodule(n)) for n in names}
    assert kinds == ({linear} if family == "llama" else {linear, experts})
    if family == "deepseek_v3":
        assert {"layers.0.attention.wq_b", "layers.0.attention.wkv_a", "layers.0.attention.wkv_b"} <= set(names)
    bytes_per_weight = {"int8": 1, "fp8": 1, "int4": 0.5}[method]
    for name in names:
        q, full = model.get_submodule(name), reference.get_submodule(name)
        parts = [("qweight", "scale", "weight")] if linear is type(q) else [
            (f"q{w}", f"{w}_scale", w) for w in ("w1", "w2", "w3")]
        for codes_key, scale_key, weight_key in parts:
            codes, scale, weight = getattr(q, codes_key), getattr(q, scale_key), full.get_parameter(weight_key)
            assert codes.numel() * codes.element_size() == weight.numel() * bytes_per_weight, name
            deq = {"int8": lambda c, s: c.float() * s[..., None], "fp8": _fp8_reference,
                   "int4": lambda c, s: _int4_reference(c, s)[1]}[method](codes, scale)
            with torch.no_grad():
                weight.copy_(deq)
    with torch.no_grad():
        torch.testing.assert_close(got, reference(ids).logits, rtol=1e-5, atol=1e-5)
    assert 0 < (got - want).norm() / want.norm() < LOGITS_TOL[method]


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_engine_greedy_generation_with_each_method(family, method, family_models):
    """Greedy generation through the engine (paged KV cache, batching) equals the eager generation
    of the same quantized model."""
    path, _ = family_models[family]
    llm = LLM(path, block_size=4, quantization=method)
    assert isinstance(llm.engine.model.layers["0"].attention.wq, LAYERS[method][0])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = llm.encode("quantized weights")
    out = llm.generate([prompt], params)[0].token_ids
    assert len(out) == 12
    assert out == reference_generate(llm.engine.model, prompt, params, use_cache=False)


def test_unknown_method_is_refused_naming_the_allowed_ones(llama):
    assert set(LAYERS) == set(QUANTIZATION_METHODS)
    with pytest.raises(ConfigError, match="quantization='int3' is invalid: None or one of 'int8', 'fp8', 'int4'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ConfigError, match="quantization='int3' is invalid: one of int8, fp8, int4"):
        quantize_by_method(load_pretrained(llama[0]), "int3")
