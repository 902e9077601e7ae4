"""`tessera quantize` on MoE models: rtn and fp8 quantize every routed expert's projections (one
weight and scales per expert, under the file's per-expert names) and DeepSeek-V3's latent-attention
projections; the compressed-tensors library decompresses each to exactly Tessera's weights, the
router is in the config's `ignore`, and Tessera loads the directory with its experts kept quantized
and computes what the dequantized weights give."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint.calibration import stored_dtype
from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.hf.names import hf_names
from tessera.checkpoint.loading import load_model
from tessera.config.hf_config import read_hf_config, read_json_object
from tessera.infer import LLM, SamplingParams
from tessera.models.stored_quant_experts import StoredQuantExperts
from tessera.quantize import QuantizeOptions, quantize
from tessera.quantize.run import method_scheme, quantize_linears
from tests.infer.tiny_models import write_model

IDS = torch.tensor([[(7 * i + 3) % 125 + 3 for i in range(24)], [(11 * i + 5) % 125 + 3 for i in range(24)]])
OPTIONS = {"rtn": QuantizeOptions(group_size=16), "rtn8": QuantizeOptions(bits=8, group_size=0),
           "fp8": QuantizeOptions()}


def _dequantized(src, method: str, options: QuantizeOptions) -> dict[str, torch.Tensor]:
    """Tessera's own quantized-then-dequantized weights, by HuggingFace module name (experts: one each)."""
    model = load_pretrained(src)
    dtype = stored_dtype(read_json_object(src / "config.json"))
    quantized = quantize_linears(model, method, method_scheme(method, options), dtype, options, None)
    names, out = hf_names(model.cfg), {}
    for name, q in quantized.items():
        keys = names[name] if isinstance(q, list) else names[f"{name}.weight"]
        for key, qe in zip(keys, q if isinstance(q, list) else [q], strict=True):
            out[key.removesuffix(".weight")] = qe.dequantize()
    return out


def _plain_with(src, ours: dict[str, torch.Tensor]):
    """The full-precision model of `src` with the weights `ours` gives (HuggingFace module name -> weight)."""
    plain = load_pretrained(src)
    names = hf_names(plain.cfg)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            keys = [k.removesuffix(".weight") for k in names.get(name, [])]
            if keys and all(k in ours for k in keys):
                p.copy_(torch.stack([ours[k] for k in keys]) if len(keys) > 1 else ours[keys[0]])
    return plain


@pytest.mark.parametrize("family, case", [("qwen3_moe", "rtn"), ("deepseek_v3", "rtn"), ("deepseek_v3", "fp8"),
                                          ("mixtral", "rtn8")])
def test_experts_and_mla_quantize_and_read_back(family, case, tmp_path):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    method = "fp8" if case == "fp8" else "rtn"
    src, dst = tmp_path / "src", tmp_path / "q"
    write_model(src, family)
    result = quantize(src, dst, method, OPTIONS[case])
    cfg = read_hf_config(src)
    ours = _dequantized(src, method, OPTIONS[case])
    experts = [p for p in ours if ".experts." in p and "shared" not in p]
    moe_layers = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    assert len(experts) == 3 * cfg.moe.num_experts * len(moe_layers)
    assert result.matrices == len(ours) and any(".moe.experts.w2" in n for n in result.layers)
    if family == "deepseek_v3":
        assert {"model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.1.self_attn.q_b_proj"} <= set(ours)
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    routers = [names[0].removesuffix(".weight") for k, names in hf_names(cfg).items() if k.endswith("router.weight")]
    assert parsed.ignore == ["lm_head", *routers] and len(routers) == len(moe_layers)
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    stored = load_file(dst / "model.safetensors")
    for prefix, weight in ours.items():
        local = {k.removeprefix(prefix + "."): v for k, v in stored.items() if k.startswith(prefix + ".")}
        assert torch.equal(compressor.decompress(local, scheme)["weight"], weight), prefix
    assert all(f"{r}.weight" in stored and stored[f"{r}.weight"].dtype == torch.float32 for r in routers)

    loaded = load_model(dst)
    kept = [m for m in loaded.model.modules() if isinstance(m, StoredQuantExperts)]
    assert len(kept) == len(moe_layers)
    plain = _plain_with(src, ours)
    with torch.no_grad():
        got, want = loaded.model(IDS).logits, plain(IDS).logits
    if method == "rtn":  # weights only: exactly the dequantized model
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # e4m3 activations per token besides
        assert 0 < float((got - want).norm() / want.norm()) < 0.2


def test_tessera_serves_a_quantized_moe(tmp_path):
    """Greedy tokens of the engine over the quantized directory equal those of the model whose
    weights are the dequantized ones (served full precision)."""
    write_model(tmp_path / "src", "qwen3_moe")
    quantize(tmp_path / "src", tmp_path / "q", "rtn", OPTIONS["rtn"])
    plain = _plain_with(tmp_path / "src", _dequantized(tmp_path / "src", "rtn", OPTIONS["rtn"]))
    quantized = LLM(str(tmp_path / "q"), block_size=4, num_blocks=64)
    reference = LLM(plain, tokenizer=quantized.tokenizer, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = IDS[0, :9].tolist()
    assert quantized.generate([prompt], params)[0].token_ids == reference.generate([prompt], params)[0].token_ids
