"""int8 weight-only quantization (at load and from a saved pre-quantized directory) and the int8
KV cache: rounding error within half a step, logits close to full precision, the saved copy equal
to quantizing at load, and a small perplexity change on held-out text."""

import pytest
import torch
from safetensors import safe_open

from tessera.checkpoint.int8 import WEIGHTS_FILE, save_quantized
from tessera.hf import load_pretrained
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.infer.perplexity import perplexity
from tessera.models.int8 import Int8GroupedExperts, Int8Linear, quantize_model, quantize_per_channel

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


def test_quantize_command_writes_a_servable_directory(llama, tmp_path):
    from tessera.infer.quant import main

    assert main([str(llama[0]), str(tmp_path / "q8")]) == 0
    out = LLM(tmp_path / "q8", block_size=4).generate(["x"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) >= 1
    assert isinstance(LLM(tmp_path / "q8", block_size=4).engine.model.layers["0"].attention.wq, Int8Linear)


def test_perplexity_change_of_int8_weights_and_kv_cache_is_small(llama):
    path, _ = llama
    results = {}
    for name, opts in {"fp32": {}, "w8": {"quantization": "int8"}, "kv8": {"kv_cache_dtype": "int8"}}.items():
        engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, num_blocks=128, **opts))
        results[name] = perplexity(engine, engine.tokenizer.encode(HELD_OUT), chunk=16)
    assert results["fp32"] > 1
    for name in ("w8", "kv8"):
        change = abs(results[name] / results["fp32"] - 1)
        assert 0 < change < 0.05, (name, results)


def test_int8_kv_cache_generates(llama):
    path, hf = llama
    llm = LLM(path, block_size=4, kv_cache_dtype="int8")
    assert llm.engine.kv.k[0].dtype == torch.int8
    out = llm.generate(["some text to continue"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 10
