"""Tiny pre-quantized HuggingFace directories for the pre-quantized loader's tests.

compressed-tensors directories are written by the compressed-tensors library itself: a random
transformers model (LLaMA, or Qwen2 for biases) with awkward sizes gets a QuantizationConfig
(`apply_quantization_config`), its weight scales and zero points from `calculate_qparams` over
each scheme's groups / channels / tensor, static input scales from one calibration forward
(quantization off while it runs), then `ModelCompressor.compress_model` and `update_config`; the
state dict is saved as model.safetensors beside the model's config.json. The returned model is the
reference: its first forward decompresses it (the library's decompression), and each quantized
linear fake-quantizes its input as the scheme says (the library's own forward).

The block-FP8 directory is written as DeepSeek-V3 stores it (`quant_method: "fp8"`, e4m3
weights, `weight_scale_inv` per block), with the weights quantized here by absmax per block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessera.data.tokenizer import DEFAULT_TOKENIZER_DIR

# Awkward sizes: 96 and 160 inputs (groups of 32 divide both), 48 key/value outputs; the bundled
# tokenizer's 4096-token vocabulary (the directories carry its tokenizer.json).
COMMON = dict(vocab_size=4096, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=0)


def tiny_model(arch: str = "llama", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**COMMON)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**COMMON)).eval()


def scheme(name: str, group_size: int = 32) -> dict:
    """The QuantizationScheme arguments (weights, input_activations) of each kind under test."""
    from compressed_tensors.quantization import QuantizationArgs as A

    int8_act = dict(num_bits=8, type="int", symmetric=True)
    fp8_act = dict(num_bits=8, type="float", symmetric=True)
    return {
        "w4a16": dict(weights=A(num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=True)),
        "w4a16_asym": dict(weights=A(num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=False)),
        "w8a16": dict(weights=A(num_bits=8, type="int", strategy="group", group_size=group_size, symmetric=True)),
        "w4a16_channel": dict(weights=A(num_bits=4, type="int", strategy="channel", symmetric=False)),
        "w8a8_dynamic": dict(weights=A(num_bits=8, type="int", strategy="channel"),
                             input_activations=A(strategy="token", dynamic=True, **int8_act)),
        "w8a8_static": dict(weights=A(num_bits=8, type="int", strategy="channel"),
                            input_activations=A(strategy="tensor", dynamic=False, **int8_act)),
        "fp8_channel_dynamic": dict(weights=A(num_bits=8, type="float", strategy="channel"),
                                    input_activations=A(strategy="token", dynamic=True, **fp8_act)),
        "fp8_tensor_static": dict(weights=A(num_bits=8, type="float", strategy="tensor"),
                                  input_activations=A(strategy="tensor", dynamic=False, **fp8_act)),
        "fp8_weight_only": dict(weights=A(num_bits=8, type="float", strategy="channel")),
    }[name]


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "group":
        w = w.unflatten(-1, (-1, args.group_size))
        return w.amin(-1), w.amax(-1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return w.min().reshape(1), w.max().reshape(1)


@torch.no_grad()
def weight_qparams(m) -> None:
    """Weight scales (and zero points) of module `m`, which the library gave a quantization scheme,
    by the library's `calculate_qparams` over the min / max of each group, channel or tensor."""
    from compressed_tensors.quantization.utils import calculate_qparams

    s = m.quantization_scheme
    lo, hi = _minmax(m.weight.float(), s.weights)
    scale, zp = calculate_qparams(lo, hi, s.weights)
    m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
    if hasattr(m, "weight_zero_point"):
        m.weight_zero_point.copy_(zp.reshape(m.weight_zero_point.shape))


@torch.no_grad()
def _calibrate(model, calib_ids: torch.Tensor) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams

    observed = {}
    hooks = []
    for name, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is None:
            continue
        weight_qparams(m)
        if s.input_activations is not None and not s.input_activations.dynamic:
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: observed.__setitem__(name, (args[0].min(), args[0].max()))))
        m.quantization_enabled = False
    model(calib_ids)
    for h in hooks:
        h.remove()
    for name, m in model.named_modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        m.quantization_enabled = True
        if name in observed:
            scale, _ = calculate_qparams(observed[name][0].reshape(1), observed[name][1].reshape(1),
                                         m.quantization_scheme.input_activations)
            m.input_scale.copy_(scale.reshape(m.input_scale.shape))


def _save(model, state: dict, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(DEFAULT_TOKENIZER_DIR / "tokenizer.json", path / "tokenizer.json")


def compress(model, path: Path, kind: str, calib_ids: torch.Tensor, ignore=("lm_head",), targets=("Linear",),
             group_size: int = 32):
    """Quantize transformers `model` in place by `scheme(kind, group_size)` with compressed-tensors
    and write it as a compressed-tensors directory at `path`; returns `model`, compressed (its
    forward is the reference)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=list(targets),
                                                                         **scheme(kind, group_size))},
                            ignore=list(ignore))
    apply_quantization_config(model, qc)
    _calibrate(model, calib_ids)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    _save(model, model.state_dict(), path)
    compressor.update_config(str(path))
    return model


def write_compressed(path: Path, kind: str, arch: str = "llama", ignore=("lm_head",), targets=("Linear",),
                     seed: int = 0):
    """A compressed-tensors directory of a tiny `arch` model quantized by `scheme(kind)`; returns
    the library's model, compressed (its forward is the reference)."""
    calib = torch.randint(0, COMMON["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    return compress(tiny_model(arch, seed), path, kind, calib, ignore, targets)


def block_fp8_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and per-block scales (absmax / 448): W ~ codes * scale[block]."""
    out_f, in_f = w.shape
    rows, cols = -(-out_f // block[0]), -(-in_f // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[:out_f, :in_f] = w.float()
    blocks = padded.reshape(rows, block[0], cols, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)[:out_f, :in_f]
    return codes.contiguous(), scale


def save_block_fp8(model, path: Path, block: tuple[int, int]) -> None:
    """Write transformers `model` as a DeepSeek-V3-style block-FP8 directory: every linear of the
    blocks quantized (`*proj.weight`), the head not."""
    state = {}
    for key, t in model.state_dict().items():
        if key.startswith("model.layers.") and key.endswith("proj.weight"):
            state[key], state[key.removesuffix("weight") + "weight_scale_inv"] = block_fp8_quantize(t, block)
        else:
            state[key] = t
    _save(model, state, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def write_block_fp8(path: Path, arch: str = "llama", block: tuple[int, int] = (64, 64), seed: int = 0):
    """A block-FP8 directory of a tiny `arch` model; returns the full-precision transformers model
    it was made from."""
    model = tiny_model(arch, seed)
    save_block_fp8(model, path, block)
    return model


@torch.no_grad()
def write_actorder(path: Path, seed: int = 0):
    """A W4A16 directory with activation ordering (`weight_g_idx`: each input column's group, here a
    random permutation of the columns cut into groups of 32), which compressed-tensors 0.20 no
    longer writes: the codes are packed by the library's `pack_to_int32` and the scales computed by
    its `calculate_qparams`, per group of columns. Returns a transformers model holding the hand
    dequantized weights W[:, i] = q[:, i] * s[:, g(i)] (the reference)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme("w4a16")["weights"]
    write_compressed(path, "w4a16", seed=seed)
    model = tiny_model("llama", seed)
    state = dict(model.state_dict())
    from safetensors.torch import load_file

    stored = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 7)
    for key in [k for k in stored if k.endswith(".weight_packed")]:
        prefix = key.removesuffix(".weight_packed")
        w = state[prefix + ".weight"].float()
        out_f, in_f = w.shape
        g_idx = (torch.randperm(in_f, generator=gen) // args.group_size).to(torch.int32)
        lo = torch.stack([w[:, g_idx == j].amin(-1) for j in range(in_f // args.group_size)], -1)
        hi = torch.stack([w[:, g_idx == j].amax(-1) for j in range(in_f // args.group_size)], -1)
        scale, _ = calculate_qparams(lo, hi, args)
        q = torch.round(torch.clamp(w / scale[:, g_idx.long()], -8, 7))
        stored[key] = pack_to_int32(q.to(torch.int8), 4)
        stored[prefix + ".weight_scale"] = scale
        stored[prefix + ".weight_g_idx"] = g_idx
        state[prefix + ".weight"] = q * scale[:, g_idx.long()]
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    model.load_state_dict(state)
    return model


def edited_quantization_config(source: Path, path: Path, edit) -> Path:
    """A copy of pre-quantized directory `source` at `path` whose config.json's quantization_config
    `edit` (a function of the dict) has changed in place."""
    shutil.copytree(source, path)
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))
    return path
