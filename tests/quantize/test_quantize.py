"""`tessera quantize`: HuggingFace in, compressed-tensors out, checked by the format's own library.

Every method's directory is read by compressed-tensors (its config parsed by `QuantizationConfig`,
each layer decompressed by the format's registered compressor) and loaded by transformers
(`AutoModelForCausalLM.from_pretrained`, which decompresses through compressed-tensors on CPU); both
give exactly the weights Tessera quantized and dequantized, and logits near the source model's.
GPTQ's output error on the calibration data is below round-to-nearest's at the same bits and group;
smoothing alone keeps the function; bad input exits 2 naming what was wrong (an option of another
method, a weight that is NaN or infinite, by tensor name, before any work)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint.calibration import load_calibration, stored_dtype
from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.hf.names import hf_names
from tessera.cli import main
from tessera.config.errors import ConfigError
from tessera.config.hf_config import read_hf_config, read_json_object
from tessera.config.presets import get_preset
from tessera.quantize import QuantizeOptions, quantize
from tessera.quantize.calibration import block_linears, input_absmax, recording_inputs
from tessera.quantize.formats import Scheme, quantize_int
from tessera.quantize.gptq import gptq_quantize, hessian_error
from tessera.quantize.run import check_model, method_scheme, quantize_linears
from tessera.quantize.smoothquant import smooth, smoothing_scales
from tests.infer.tiny_models import save_tokenizer, write_model
from tests.models.hf_families import hf_configs, random_hf_model
from tests.quantize.damaged_sources import with_nonfinite_weight

CALIBRATION = dict(num_sequences=4, seq_len=48)
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i}\n" for i in range(200))
# Awkward sizes: 3 heads of 32, 1 KV group, FFN 160 (not a power of two); groups of 32 divide all inputs.
SIZES = dict(hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1)
CASES = {  # name -> (method, options, largest relative logit error against the source)
    "rtn-w4-g32": ("rtn", dict(group_size=32), 0.45),
    "rtn-w8-channel": ("rtn", dict(bits=8, group_size=0), 0.04),
    "gptq-w4-g32": ("gptq", dict(group_size=32), 0.45),
    "gptq-w4-g32-actorder": ("gptq", dict(group_size=32, actorder=True), 0.45),
    "smoothquant": ("smoothquant", {}, 0.06),
    "fp8": ("fp8", {}, 0.2),  # e4m3 activations: 3 mantissa bits on every input
}


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "hf"
    write_model(path, "llama", seed=3, **SIZES)
    return path


def _options(method: str, extra: dict, calibration: Path) -> QuantizeOptions:
    calibrated = dict(calibration=[calibration], **CALIBRATION) if method in ("gptq", "smoothquant") else {}
    return QuantizeOptions(**extra, **calibrated)


def _tesseras_weights(src: Path, method: str, options: QuantizeOptions) -> dict[str, torch.Tensor]:
    """Tessera's own quantized-then-dequantized weights, by HuggingFace module name."""
    cfg = read_hf_config(src)
    tokens = None
    if method in ("gptq", "smoothquant"):
        tokens, _ = load_calibration("test", src, cfg, options.calibration, options.num_sequences, options.seq_len)
    model = load_pretrained(src)
    dtype = stored_dtype(read_json_object(src / "config.json"))
    quantized = quantize_linears(model, method, method_scheme(method, options), dtype, options, tokens)
    names = hf_names(cfg)
    return {names[f"{n}.weight"][0].removesuffix(".weight"): q.dequantize() for n, q in quantized.items()}


def _ids() -> torch.Tensor:
    return torch.tensor([[(7 * i + 3) % 125 + 3 for i in range(40)], [(11 * i + 5) % 125 + 3 for i in range(40)]])


@pytest.mark.parametrize("case", list(CASES))
def test_the_format_library_and_transformers_read_tesseras_weights(case, llama, calibration, tmp_path):
    method, extra, tolerance = CASES[case]
    _check_output(llama, tmp_path / "q", method, _options(method, extra, calibration), tolerance)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama_tied_bias", "mistral", "smollm3", "olmo2"])
def test_each_dense_family(family, calibration, tmp_path):
    """QKV biases (qwen2), QK norm and a wider attention (qwen3), a tied head (llama_tied_bias),
    a sliding window (mistral), layers without RoPE (smollm3), norms after attention and MLP and a
    QK norm over all heads (olmo2): GPTQ with groups of 16, its weights read back exactly."""
    cfg = hf_configs()[family]
    cfg.vocab_size = 128  # the character tokenizer's
    random_hf_model(cfg, seed=2).save_pretrained(tmp_path / "src")
    save_tokenizer(tmp_path / "src")
    options = _options("gptq", dict(group_size=16), calibration)
    _check_output(tmp_path / "src", tmp_path / "q", "gptq", options, 0.5)


def test_smoothquant_folds_its_scales_into_gemmas_offset_norms(calibration, tmp_path):
    """Gemma 3's norms scale by (1 + weight): the smoothing divides that gain, not the stored weight
    (dividing the stored weight leaves the tiny model's logits 0.59 off; the fold, 0.07)."""
    cfg = hf_configs()["gemma3_text"]
    cfg.vocab_size = 128
    random_hf_model(cfg, seed=2).save_pretrained(tmp_path / "src")
    save_tokenizer(tmp_path / "src")
    _check_output(tmp_path / "src", tmp_path / "q", "smoothquant", _options("smoothquant", {}, calibration), 0.1)


def test_phi3s_fused_projections_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"family 'phi3' stores q, k, v and the MLP's gate and up projections "
                                          r"fused \(qkv_proj, gate_up_proj\)"):
        check_model(get_preset("phi3-mini-4k"), None, "rtn")


@pytest.mark.parametrize("method", ["rtn", "fp8"])
def test_a_bfloat16_source_keeps_bfloat16_scales(method, tmp_path):
    from transformers import AutoModelForCausalLM

    model = write_model(tmp_path / "fp32", "llama", seed=4, **SIZES)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    save_tokenizer(tmp_path / "src")
    options = QuantizeOptions(group_size=32) if method == "rtn" else QuantizeOptions()
    _check_output(tmp_path / "src", tmp_path / "q", method, options, 0.45)
    scales = [t for k, t in load_file(tmp_path / "q" / "model.safetensors").items() if k.endswith("weight_scale")]
    assert scales and all(t.dtype == torch.bfloat16 for t in scales)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype="auto").dtype == torch.bfloat16


def _check_output(src: Path, dst: Path, method: str, options: QuantizeOptions, tolerance: float) -> None:
    """`quantize` src -> dst, then read dst with compressed-tensors and transformers (module docstring)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from transformers import AutoModelForCausalLM

    result = quantize(src, dst, method, options)
    ours = _tesseras_weights(src, method, options)
    assert len(ours) == len(result.layers) == 7 * read_hf_config(src).n_layers
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)  # the library's own reading of the config
    assert parsed.quantization_status == "compressed" and parsed.ignore == ["lm_head"]
    assert parsed.format == result.scheme.format
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    stored = load_file(dst / "model.safetensors")
    for prefix, weight in ours.items():
        local = {k.removeprefix(prefix + "."): v for k, v in stored.items() if k.startswith(prefix + ".")}
        assert "weight" in compressor.decompress(local, scheme)
        assert torch.equal(compressor.decompress(local, scheme)["weight"], weight), prefix
    dtype = stored_dtype(read_json_object(src / "config.json"))  # the scales' dtype: the product's rounding
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=dtype).eval()
    with torch.no_grad():
        logits = hf(_ids()).logits.float()  # the first forward pass decompresses the weights (compressed-tensors)
    for prefix, weight in ours.items():
        assert torch.equal(hf.get_submodule(prefix).weight.float(), weight.float()), prefix
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        original = source(_ids()).logits
        error = float((logits - original).norm() / original.norm())
        assert 0 < error < tolerance
        if not result.scheme.dynamic_activations and dtype == torch.float32:  # the source with Tessera's weights
            for prefix, weight in ours.items():
                source.get_submodule(prefix).weight.copy_(weight)
            torch.testing.assert_close(logits, source(_ids()).logits, rtol=1e-5, atol=1e-5)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()


def test_gptq_output_error_is_below_round_to_nearest(llama, calibration):
    """Each layer of the first block, on the inputs the calibration data gives it: GPTQ's output
    error (measured directly, ||X W^T - X Q^T||^2) is lower than RTN's at the same bits and group."""
    cfg = read_hf_config(llama)
    tokens, _ = load_calibration("test", llama, cfg, [calibration], **CALIBRATION)
    model = load_pretrained(llama)
    linears = block_linears(model, "0")
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: inputs[n].append(args[0].flatten(0, -2)))
               for n, m in linears.items()]
    with recording_inputs(linears, hessian=True) as stats, torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    for bits in (4, 8):
        scheme = Scheme("int", bits, 32, False)
        for name, m in linears.items():
            x, w = torch.cat(inputs[name]).double(), m.weight.detach()
            rtn = quantize_int(w, scheme, torch.float32).dequantize()
            gptq = gptq_quantize(w, stats[name].hessian(), scheme, torch.float32).dequantize()
            err_rtn, err_gptq = ((x @ (w - rtn).double().T) ** 2).sum(), ((x @ (w - gptq).double().T) ** 2).sum()
            assert err_gptq < 0.95 * err_rtn, (name, bits, float(err_gptq), float(err_rtn))
            h = stats[name].hessian()
            assert hessian_error(w, gptq, h) == pytest.approx(2 * float(err_gptq) / x.shape[0], rel=1e-6)


def test_smoothing_alone_keeps_the_logits(llama, calibration):
    cfg = read_hf_config(llama)
    tokens, _ = load_calibration("test", llama, cfg, [calibration], **CALIBRATION)
    model = load_pretrained(llama)
    with torch.no_grad():
        before = model(tokens).logits
        norm_before = model.layers["0"].attention_norm.weight.clone()
        assert smooth(model, input_absmax(model, tokens), alpha=0.5) == 2 * cfg.n_layers
        after = model(tokens).logits
        changed = model.layers["0"].attention_norm.weight / norm_before
    assert float(changed.max() / changed.min()) > 1.5  # the smoothing did move scale between the two
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_cli_writes_the_directory(llama, tmp_path, capsys):
    dst = tmp_path / "q"
    assert main(["quantize", str(llama), str(dst), "--method", "rtn", "--group-size", "32", "--bits", "8"]) == 0
    assert "int8 weights, group 32 (pack-quantized)" in capsys.readouterr().out
    config = json.loads((dst / "config.json").read_text())
    q = config.pop("quantization_config")
    assert q["quant_method"] == "compressed-tensors" and q["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    assert config == json.loads((llama / "config.json").read_text())  # otherwise the source's config.json


@pytest.mark.parametrize("args, says", [
    (["--method", "rtn", "--group-size", "64"], "--group-size 64 does not divide"),
    (["--method", "fp8", "--bits", "4"], "--bits / --group-size apply to rtn and gptq"),
    (["--method", "rtn", "--calibration", "x.txt"], "--calibration applies to gptq and smoothquant"),
    # an option of another method is refused naming it and its method, never accepted and ignored
    (["--method", "gptq", "--alpha", "0.3"], "--alpha applies to smoothquant only, not to gptq"),
    (["--method", "smoothquant", "--dampening", "0.1"], "--dampening applies to gptq only, not to smoothquant"),
    (["--method", "rtn", "--actorder"], "--actorder applies to gptq only, not to rtn"),
    (["--method", "fp8", "--dampening", "0"], "--dampening applies to gptq only, not to fp8"),
    (["--method", "rtn", "--calibration-sequences", "4"], "--calibration-sequences applies to gptq and smoothquant"),
    (["--method", "fp8", "--calibration-length", "16"], "--calibration-length applies to gptq and smoothquant"),
    (["--method", "smoothquant", "--group-size", "0"], "--bits / --group-size apply to rtn and gptq"),
])
def test_bad_options_exit_2(llama, tmp_path, capsys, args, says):
    assert main(["quantize", str(llama), str(tmp_path / "q"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("method, option", [("gptq", dict(alpha=0.5)), ("smoothquant", dict(dampening=0.01)),
                                            ("rtn", dict(actorder=True)), ("fp8", dict(num_sequences=16))])
def test_the_api_refuses_options_of_other_methods_too(method, option, llama, tmp_path):
    """Even at an option's default value: given is given."""
    with pytest.raises(ConfigError, match=f"applies to .* only, not to {method}"):
        quantize(llama, tmp_path / "q", method, QuantizeOptions(**option))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("method, key, value", [
    ("rtn", "model.layers.1.mlp.down_proj.weight", float("nan")),
    ("gptq", "model.layers.0.self_attn.q_proj.weight", float("nan")),  # was a LinAlgError traceback
    ("smoothquant", "model.layers.0.input_layernorm.weight", float("inf")),
    ("fp8", "model.embed_tokens.weight", float("-inf")),
])
def test_non_finite_weights_are_refused_by_name_before_any_work(method, key, value, llama, calibration, tmp_path,
                                                                capsys):
    src = with_nonfinite_weight(llama, tmp_path / "src", key, value)
    calibrated = ["--calibration", str(calibration)] if method in ("gptq", "smoothquant") else []
    extra = ["--group-size", "32"] if method in ("rtn", "gptq") else []
    assert main(["quantize", str(src), str(tmp_path / "q"), "--method", method, *calibrated, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"tensor {key!r} (in model.safetensors) is not finite (1 of its" in err and "refusing to quantize" in err
    assert not (tmp_path / "q").exists()


def test_bad_input_exits_2(llama, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:  # argparse: an unknown method
        main(["quantize", str(llama), str(tmp_path / "q"), "--method", "awq"])
    assert stop.value.code == 2 and "invalid choice: 'awq'" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path), str(tmp_path / "q"), "--method", "rtn"]) == 2
    assert "is not a HuggingFace model directory" in capsys.readouterr().err
    (tmp_path / "gpt2").mkdir()
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 128, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(gpt2))
    assert main(["quantize", str(tmp_path / "gpt2"), str(tmp_path / "q"), "--method", "rtn"]) == 2
    assert "is not a model Tessera can quantize: unsupported architecture model_type='gpt2'" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["quantize", str(llama), str(tmp_path / "full"), "--method", "fp8"]) == 2
    assert "is not empty" in capsys.readouterr().err
    quantized = tmp_path / "fp8"
    assert main(["quantize", str(llama), str(quantized), "--method", "fp8"]) == 0
    assert main(["quantize", str(quantized), str(tmp_path / "again"), "--method", "fp8"]) == 2
    assert "is quantized already" in capsys.readouterr().err


@pytest.mark.parametrize("method, family, says", [
    ("gptq", "mixtral", "family 'mixtral' has routed experts (MoE), which gptq does not quantize (its calibration"),
    ("smoothquant", "deepseek_v3", "family 'deepseek_v3' has routed experts (MoE), which smoothquant does not"),
])
def test_calibrated_methods_refuse_moe_by_name(method, family, says, tmp_path, capsys):
    """rtn and fp8 quantize routed experts and MLA (tests/quantize/test_quantize_moe.py); the calibrated
    methods refuse them, naming the part and the methods that do."""
    write_model(tmp_path / "src", family)
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "q"), "--method", method]) == 2
    err = capsys.readouterr().err
    assert says in err and "quantize this model with --method rtn or fp8" in err
    assert not (tmp_path / "q").exists()


def test_smoothquant_refuses_norms_after_the_sublayers_by_name(tmp_path, capsys):
    """OLMo 2 has no RMSNorm before its projections to fold the smoothing into; gptq quantizes it."""
    write_model(tmp_path / "src", "olmo2")
    capsys.readouterr()
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "q"), "--method", "smoothquant"]) == 2
    err = capsys.readouterr().err
    assert "family 'olmo2' has none there" in err and "--method gptq, rtn or fp8" in err and err.count("\n") == 1
    assert not (tmp_path / "q").exists()


def _per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token symmetric int8 fake quantization (the W8A8 scheme's input activations)."""
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    return torch.round(x / scale).clamp(-128, 127) * scale


def test_smoothing_lowers_the_w8a8_error_of_outlier_channels(llama, calibration):
    """Activations with a few channels 30x larger (as LLMs have, the paper's motivation): int8 inputs
    per token and int8 weights per channel lose less of q/k/v's output after smoothing than before."""
    cfg = read_hf_config(llama)
    tokens, _ = load_calibration("test", llama, cfg, [calibration], **CALIBRATION)
    model = load_pretrained(llama)
    with torch.no_grad():
        model.layers["0"].attention_norm.weight[:3] = 30.0
    linears = {n: m for n, m in block_linears(model, "0").items() if n.split(".")[-1] in ("wq", "wk", "wv")}
    with recording_inputs(linears, hessian=False) as stats, torch.no_grad():
        model(tokens)
    captured: list[torch.Tensor] = []
    handle = linears["layers.0.attention.wq"].register_forward_pre_hook(lambda m, a: captured.append(a[0]))
    with torch.no_grad():
        model(tokens)
    handle.remove()
    x = captured[0].flatten(0, -2).double()
    weights = [m.weight.detach().double() for m in linears.values()]
    s = smoothing_scales(stats["layers.0.attention.wq"].absmax, weights, alpha=0.5)
    scheme = Scheme("int", 8, None, True)

    def error(x_in: torch.Tensor, ws: list[torch.Tensor]) -> float:
        xq = _per_token_int8(x_in)
        return sum(float(((x @ w.T) - xq @ quantize_int(ww, scheme, torch.float64).dequantize().T).pow(2).sum())
                   for w, ww in zip(weights, ws, strict=True))

    plain, smoothed = error(x, weights), error(x / s, [w * s for w in weights])
    assert smoothed < 0.5 * plain, (smoothed, plain)


@pytest.mark.parametrize("case", ["rtn-w4-g32", "gptq-w4-g32", "smoothquant", "fp8"])
def test_tessera_serves_its_own_quantized_directories(case, llama, calibration, tmp_path):
    """What `tessera quantize` writes, Tessera serves: the pre-quantized loader keeps the codes, its
    logits equal transformers' reading of the directory, the engine's greedy tokens transformers'."""
    from transformers import AutoModelForCausalLM

    from tessera.checkpoint.prequantized.load import load_prequantized
    from tessera.infer import LLM, SamplingParams
    from tests.infer.tiny_models import hf_greedy

    method, extra, _ = CASES[case]
    dst = tmp_path / "quantized"
    result = quantize(llama, dst, method, _options(method, extra, calibration))
    model, layers = load_prequantized(dst)
    assert sorted(layers) and len(layers) == len(result.layers)
    kept = {b.dtype for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in ("weight_packed", "weight")}
    assert kept and kept <= {torch.int32, torch.int8, torch.float8_e4m3fn}  # codes, not dequantized copies
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(_ids()).logits
        got = model(_ids()).logits.float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    prompt = [0, *(_ids()[0, :12].tolist())]
    out = LLM(dst, block_size=4).generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(hf, prompt, 10)
