"""Pre-quantized HuggingFace directories (tessera/checkpoint/prequantized): compressed-tensors
directories written by the compressed-tensors library give the logits of the library's own
decompressed model (its forward fake-quantizes the activations the scheme quantizes), DeepSeek-V3
block FP8 gives transformers' FP8 dequantizing loader's logits, the weights stay quantized in
memory, the serving engine generates greedily what the reference does, and what is not supported
is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.checkpoint.loading import load_model
from tessera.config.errors import CheckpointError, ConfigError
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.models.stored_quant import (
    BlockFp8Linear,
    FloatQuantizedLinear,
    IntQuantizedLinear,
    PackedIntLinear,
    StoredQuantLinear,
)
from tests.checkpoint.quantized_checkpoints import (
    tiny_model,
    write_actorder,
    write_block_fp8,
    write_compressed,
)
from tests.infer.tiny_models import hf_greedy

IDS = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(3))
# kind -> (layer class, its code buffer, the code dtype, bits per weight)
KINDS = {
    "w4a16": (PackedIntLinear, "weight_packed", torch.int32, 4),
    "w4a16_asym": (PackedIntLinear, "weight_packed", torch.int32, 4),
    "w8a16": (PackedIntLinear, "weight_packed", torch.int32, 8),
    "w4a16_channel": (PackedIntLinear, "weight_packed", torch.int32, 4),
    "w8a8_dynamic": (IntQuantizedLinear, "weight", torch.int8, 8),
    "w8a8_static": (IntQuantizedLinear, "weight", torch.int8, 8),
    "fp8_channel_dynamic": (FloatQuantizedLinear, "weight", torch.float8_e4m3fn, 8),
    "fp8_tensor_static": (FloatQuantizedLinear, "weight", torch.float8_e4m3fn, 8),
    "fp8_weight_only": (FloatQuantizedLinear, "weight", torch.float8_e4m3fn, 8),
}


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def quantized_layers(model) -> dict[str, StoredQuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, StoredQuantLinear)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_compressed_tensors_logits_equal_the_librarys_decompression(kind, tmp_path):
    arch = "qwen2" if kind == "fp8_channel_dynamic" else "llama"  # Qwen2: q/k/v biases beside the codes
    reference = write_compressed(tmp_path, kind, arch=arch)
    loaded = load_model(tmp_path)
    want = logits(reference)
    got = logits(loaded.model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - logits(tiny_model(arch))).abs().max() > 1e-4  # the quantization is there to see
    layer_cls, code, code_dtype, bits = KINDS[kind]
    layers = quantized_layers(loaded.model)
    assert sorted(layers) == sorted(loaded.quantized) and len(layers) == 14  # 7 linears x 2 blocks; head not
    for m in layers.values():
        assert type(m) is layer_cls and getattr(m, code).dtype == code_dtype
        assert getattr(m, code).numel() * getattr(m, code).element_size() == m.out_features * m.in_features * bits // 8
        assert not any(t.is_floating_point() and t.shape == (m.out_features, m.in_features)
                       for t in m.state_dict().values() if t.dtype != torch.float8_e4m3fn)
    assert loaded.model.output.weight.dtype == torch.float32  # the head stays full precision


def test_activation_order_g_idx(tmp_path):
    reference = write_actorder(tmp_path)
    loaded = load_model(tmp_path)
    assert all(hasattr(m, "weight_g_idx") for m in quantized_layers(loaded.model).values())
    torch.testing.assert_close(logits(loaded.model), logits(reference), rtol=1e-5, atol=1e-5)


def test_block_fp8_equals_transformers_fp8_loading(tmp_path):
    """Blocks that divide every weight: transformers' FineGrainedFP8 loader with dequantize=True
    (on CPU) is the reference. (It reads the block size off the scale grid, so it cannot read the
    partial blocks of the next test.)"""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    write_block_fp8(tmp_path, block=(16, 16))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=FineGrainedFP8Config(
        dequantize=True), dtype=torch.float32).eval()
    loaded = load_model(tmp_path)
    layers = quantized_layers(loaded.model)
    assert len(layers) == 14 and all(type(m) is BlockFp8Linear and m.weight.dtype == torch.float8_e4m3fn
                                     for m in layers.values())
    torch.testing.assert_close(logits(loaded.model), logits(reference), rtol=1e-5, atol=1e-5)


def test_block_fp8_partial_blocks_equal_a_hand_dequantization(tmp_path):
    """64 x 64 blocks over 48-, 96- and 160-wide weights: the last block row / column is partial."""
    from safetensors.torch import load_file

    full = write_block_fp8(tmp_path, block=(64, 64))
    stored = load_file(str(tmp_path / "model.safetensors"))
    state = dict(full.state_dict())
    for key, scale in stored.items():
        if key.endswith("weight_scale_inv"):
            codes = stored[key.removesuffix("_scale_inv")].float()
            for r in range(scale.shape[0]):
                for c in range(scale.shape[1]):
                    codes[r * 64:(r + 1) * 64, c * 64:(c + 1) * 64] *= scale[r, c]
            state[key.removesuffix("_scale_inv")] = codes
    full.load_state_dict(state)
    torch.testing.assert_close(logits(load_model(tmp_path).model), logits(full), rtol=1e-5, atol=1e-5)


def test_served_greedy_generation_equals_the_reference(tmp_path):
    reference = write_compressed(tmp_path, "w4a16_asym")
    llm = LLM(str(tmp_path), block_size=4, num_blocks=64)
    assert quantized_layers(llm.engine.model)
    prompt = IDS[0, :9].tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(reference, prompt, 8)
    with pytest.raises(ConfigError, match="pre-quantized compressed-tensors pack-quantized \\(serve it without"):
        LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, num_blocks=64, quantization="int8"))
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 is not supported for a pre-quantized"):
        LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, num_blocks=64, tensor_parallel_size=2))


def _edit_config(path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(quant_method="gptq"), "quant_method='gptq' is not supported; Tessera loads pre-quantized "
                                              "checkpoints with quant_method 'compressed-tensors' or 'fp8'"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity \\(e.g. 2:4\\) is not supported"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "KV-cache quantization"),
    (lambda q: q.update(quantization_status="frozen"), "quantization_status='frozen' is not supported"),
    (lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
     "format 'nvfp4-pack-quantized' is not supported; Tessera loads formats pack-quantized"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int",
                                                                       "strategy": "token", "dynamic": True}),
     "pack-quantized with input_activations is not supported"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), "num_bits=3 is not supported"),
])
def test_foreign_quantization_config_is_refused_by_name(tmp_path, edit, message):
    write_compressed(tmp_path, "w4a16")
    _edit_config(tmp_path, edit)
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path)


def test_a_quantized_head_is_refused_by_name(tmp_path):
    write_compressed(tmp_path, "w8a8_dynamic", ignore=())
    with pytest.raises(ConfigError, match="lm_head is stored quantized, which Tessera does not load for "
                                              "output.weight"):
        load_model(tmp_path)


def test_targets_and_ignore_choose_the_layers(tmp_path):
    """Only the MLP's projections targeted (a regex), and layer 1's down projection ignored by name."""
    reference = write_compressed(tmp_path, "w8a16", targets=("re:.*mlp\\..*_proj$",),
                                 ignore=("lm_head", "model.layers.1.mlp.down_proj"))
    loaded = load_model(tmp_path)
    assert sorted(loaded.quantized) == ["layers.0.feed_forward.w1", "layers.0.feed_forward.w2",
                                        "layers.0.feed_forward.w3", "layers.1.feed_forward.w1",
                                        "layers.1.feed_forward.w3"]
    torch.testing.assert_close(logits(loaded.model), logits(reference), rtol=1e-5, atol=1e-5)


def test_full_precision_paths_refuse_a_prequantized_directory(tmp_path):
    from tessera.checkpoint.convert import convert
    from tessera.checkpoint.hf.load import load_pretrained

    write_block_fp8(tmp_path / "m", block=(16, 16))
    for call in (lambda: load_pretrained(tmp_path / "m"), lambda: convert(tmp_path / "m", tmp_path / "out")):
        with pytest.raises(ConfigError, match="is pre-quantized \\(quantization_config.quant_method='fp8'\\): "
                                                  "this needs full-precision weights"):
            call()


def test_damaged_quantized_tensors_are_named(tmp_path):
    """A scale missing, codes in the wrong dtype, a stray KV-cache scale: CheckpointError naming
    the tensor."""
    from safetensors.torch import load_file, save_file

    write_compressed(tmp_path, "w8a8_static")
    original = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.1.self_attn.o_proj"
    for edit, message in ((lambda s: s.pop(f"{key}.weight_scale"), f"has no '{key}.weight_scale'"),
                          (lambda s: s.update({f"{key}.weight": s[f"{key}.weight"].float()}),
                           f"'{key}.weight' is float32; the scheme stores it as int8"),
                          (lambda s: s.update({"model.layers.0.self_attn.k_scale": torch.ones(1)}),
                           "it has 'model.layers.0.self_attn.k_scale', which the model has no place for")):
        state = dict(original)
        edit(state)
        save_file(state, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            load_model(tmp_path)


def _block_fp8_moe(path, quantize) -> None:
    """Rewrite the tiny Mixtral directory at `path` as block FP8, the tensors `quantize(key)` picks."""
    from safetensors.torch import load_file, save_file

    from tests.checkpoint.quantized_checkpoints import block_fp8_quantize

    state = load_file(str(path / "model.safetensors"))
    for key in [k for k in state if quantize(k)]:
        state[key], state[key.removesuffix("weight") + "weight_scale_inv"] = block_fp8_quantize(state[key], (16, 16))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    (path / "config.json").write_text(json.dumps(cfg))


def _dense_linear(key: str) -> bool:
    """Attention / MLA projections and shared experts: the linears Tessera loads quantized in an MoE model."""
    return (".self_attn." in key or ".shared_experts." in key) and key.endswith(".weight") and "norm" not in key


def _dequantized_state(model, state: dict) -> None:
    """Put the dequantized weight of every checkpoint-quantized layer of `model` (linear layers, and
    each routed expert's projections) into HuggingFace state `state`, in place."""
    from tessera.checkpoint.hf.names import hf_names
    from tessera.models.stored_quant_experts import PROJECTIONS, StoredQuantExperts

    names = hf_names(model.cfg)
    for name, m in model.named_modules():
        if isinstance(m, StoredQuantExperts):
            for p in PROJECTIONS:
                for key, layer in zip(names[f"{name}.{p}"], getattr(m, p), strict=True):
                    state[key] = layer.dequantized_weight(torch.float32)
        elif isinstance(m, StoredQuantLinear) and ".moe.experts." not in name:
            state[names[f"{name}.weight"][0]] = m.dequantized_weight(torch.float32)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_moe_and_mla_linears_and_routed_experts_load_quantized(family, tmp_path):
    """Mixtral's attention, DeepSeek-V3's MLA projections and shared experts in block FP8 (16 x 16
    blocks, partial ones at the edges) load quantized, first with the routed experts and router in
    full precision, then with the routed experts quantized too, and equal the same model whose
    weights there are the dequantized ones, loaded full precision."""
    from safetensors.torch import load_file, save_file

    from tests.infer.tiny_models import write_model

    for d in ("fp", "q", "experts"):
        write_model(tmp_path / d, family)
    _block_fp8_moe(tmp_path / "q", _dense_linear)
    _block_fp8_moe(tmp_path / "experts", lambda k: _dense_linear(k) or ".experts." in k and "shared" not in k)
    original = load_file(str(tmp_path / "fp" / "model.safetensors"))
    ids = IDS % 128
    for d, routed in (("q", False), ("experts", True)):
        loaded = load_model(tmp_path / d)
        layers = quantized_layers(loaded.model)
        assert layers and all(".router" not in n for n in layers)
        assert any(".moe.experts" in n for n in layers) == routed
        state = dict(original)
        _dequantized_state(loaded.model, state)
        assert sum(not torch.equal(state[k], original[k]) for k in state) == sum(
            _dense_linear(k) or routed and ".experts." in k and "shared" not in k for k in state)
        save_file(state, str(tmp_path / "fp" / "model.safetensors"), metadata={"format": "pt"})
        torch.testing.assert_close(logits(loaded.model, ids), logits(load_model(tmp_path / "fp").model, ids),
                                   rtol=1e-5, atol=1e-5)


def test_dynamic_lora_over_a_compressed_tensors_directory(tmp_path):
    """PEFT adapters served over W4A16 layers give the tokens of the same adapters over the model
    with those layers' dequantized weights as plain nn.Linear."""
    import peft
    from torch import nn

    from tessera.models.int8 import replace_module

    write_compressed(tmp_path / "m", "w4a16")
    torch.manual_seed(5)
    lora = peft.LoraConfig(r=4, lora_alpha=9, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft.get_peft_model(tiny_model("llama"), lora).save_pretrained(tmp_path / "a")
    adapters = {"a": str(tmp_path / "a")}
    quantized = LLM(str(tmp_path / "m"), block_size=4, num_blocks=64, lora_adapters=adapters)
    plain_model = load_model(tmp_path / "m").model
    for name, m in quantized_layers(plain_model).items():
        linear = nn.Linear(m.in_features, m.out_features, bias=False)
        linear.weight.data = m.dequantized_weight(torch.float32)
        replace_module(plain_model, name, linear)
    plain = LLM(plain_model, tokenizer=quantized.tokenizer, block_size=4, num_blocks=64, lora_adapters=adapters)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = IDS[1, :7].tolist()
    got = {a: quantized.generate([prompt], params, adapter=a)[0].token_ids for a in ("a", None)}
    assert got["a"] != got[None]  # the adapter matters
    for adapter in ("a", None):
        assert got[adapter] == plain.generate([prompt], params, adapter=adapter)[0].token_ids, adapter
