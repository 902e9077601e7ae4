"""`quantize(src, dst, method, ...)`: a HuggingFace directory in, the same model quantized once
(statically) out, in compressed-tensors format.

    result = quantize("llama-1b/", "llama-1b-w4a16/", "gptq")

Methods (every linear layer of the transformer blocks, and for rtn and fp8 every routed expert's
projections and the latent attention's (MLA) projections; embedding, norms, router and output head
stay as they are):

- `rtn`: round-to-nearest int weights, W4A16 group 128 by default (`bits`, `group_size`);
- `gptq`: GPTQ (gptq.py) on calibration data, block by block (calibration.py), same formats as rtn;
- `smoothquant`: SmoothQuant smoothing (smoothquant.py), then int8 per-channel weights and dynamic
  per-token int8 activations (W8A8);
- `fp8`: e4m3 per-channel weights, dynamic per-token e4m3 activations (FP8_DYNAMIC); no calibration.

Routed experts are quantized expert by expert, each projection its own weight and scales, and
written under the checkpoint's per-expert names (`...experts.{j}.gate_proj`), as llm-compressor
lays out an MoE model. Refused by name (ConfigError): gptq and smoothquant on a model with routed
experts or latent attention (gptq's calibration hooks see linear layers, not the experts' grouped
product, and smoothquant's fold is written for the dense attention and MLP); a group size that
does not divide a layer's inputs; options that do not apply to the method (`--alpha` for gptq,
`--dampening` for smoothquant, `--actorder` for rtn: never accepted and ignored); a source whose
weights hold a NaN or an infinity, naming the tensor, before any work (GPTQ's Cholesky factorization
would fail on it, and the other methods would write it silently).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from tessera.checkpoint.calibration import check_finite_weights, load_calibration, stored_dtype
from tessera.checkpoint.convert import check_new_destination
from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.hf.names import hf_fused_rows
from tessera.config.errors import CheckpointError, ConfigError, ModelError
from tessera.config.hf_config import is_hf_directory, read_hf_config, read_json_object
from tessera.config.model import ModelConfig
from tessera.models.int8 import quantizable_layers
from tessera.models.transformer import Transformer
from tessera.quantize.calibration import input_absmax, quantize_blocks
from tessera.quantize.formats import QuantizedWeight, Scheme, quantize_fp8, quantize_int
from tessera.quantize.gptq import DEFAULT_BLOCK, DEFAULT_DAMPENING, gptq_quantize
from tessera.quantize.smoothquant import DEFAULT_ALPHA, smooth
from tessera.quantize.writer import write_compressed

METHODS = ("rtn", "gptq", "smoothquant", "fp8")
CALIBRATED = ("gptq", "smoothquant")
DEFAULT_BITS = 4
DEFAULT_GROUP = 128
DEFAULT_SEQUENCES = 16  # GPTQ's paper calibrates on 128 x 2048 tokens; a CPU run keeps it small
DEFAULT_SEQ_LEN = 256


@dataclass(frozen=True)
class QuantizeOptions:
    """What `quantize` does beyond the method; None fields: the method's default. An option given
    (not None, not False) to a method it does not apply to is refused (`check_method_options`)."""

    bits: int | None = None  # rtn / gptq: 4 or 8 (default 4)
    group_size: int | None = None  # rtn / gptq: inputs per scale, 0 = one per output channel (default 128)
    actorder: bool = False  # gptq: visit columns by decreasing Hessian diagonal
    dampening: float | None = None  # gptq: fraction of mean(diag H) added to the diagonal (default 0.01)
    block_size: int = DEFAULT_BLOCK  # gptq: columns per lazy update
    alpha: float | None = None  # smoothquant: migration strength (default 0.5)
    calibration: Sequence[str | os.PathLike] | None = None  # gptq / smoothquant: text / JSONL; None: the bundled corpus
    num_sequences: int | None = None  # gptq / smoothquant (default 16)
    seq_len: int | None = None  # gptq / smoothquant (default 256)

    def resolved(self) -> QuantizeOptions:
        """These options with the defaults in place of the None fields the methods read."""
        return replace(self, dampening=DEFAULT_DAMPENING if self.dampening is None else self.dampening,
                       alpha=DEFAULT_ALPHA if self.alpha is None else self.alpha,
                       num_sequences=DEFAULT_SEQUENCES if self.num_sequences is None else self.num_sequences,
                       seq_len=DEFAULT_SEQ_LEN if self.seq_len is None else self.seq_len)


# The options of some methods only: field -> (the option as the command line spells it, the methods it applies to)
METHOD_OPTIONS = {"bits": ("--bits", ("rtn", "gptq")), "group_size": ("--group-size", ("rtn", "gptq")),
                  "actorder": ("--actorder", ("gptq",)), "dampening": ("--dampening", ("gptq",)),
                  "alpha": ("--alpha", ("smoothquant",)), "calibration": ("--calibration", CALIBRATED),
                  "num_sequences": ("--calibration-sequences", CALIBRATED),
                  "seq_len": ("--calibration-length", CALIBRATED)}


@dataclass(frozen=True)
class QuantizeResult:
    path: Path
    scheme: Scheme
    layers: list[str]  # Tessera names of the quantized linear layers and routed experts' projections
    matrices: int  # quantized weight matrices, as the file stores them (each expert's projections its own)
    calibration_tokens: int

    def summary(self) -> str:
        s = self.scheme
        what = f"{s.kind}{s.bits} weights, " + ("per channel" if s.group_size is None else f"group {s.group_size}")
        acts = f", dynamic per-token {s.kind}8 activations" if s.dynamic_activations else ""
        return (f"{self.matrices} linear layers: {what}{acts} ({s.format}); "
                f"{self.calibration_tokens} calibration tokens")


def check_method_options(method: str, options: QuantizeOptions) -> None:
    """Refuse (ConfigError, naming the option and the methods it belongs to) an option given to a
    method that would ignore it."""
    if method not in METHODS:
        raise ConfigError(f"quantize --method {method!r} is unknown; choose one of {', '.join(METHODS)}")
    for field, (option, methods) in METHOD_OPTIONS.items():
        value = getattr(options, field)
        if method in methods or value is None or value is False or (isinstance(value, (list, tuple)) and not value):
            continue
        if field in ("bits", "group_size"):
            raise ConfigError(f"quantize --bits / --group-size apply to rtn and gptq; {method} writes 8-bit weights "
                              "with one scale per output channel")
        if field == "calibration":
            raise ConfigError(f"quantize --calibration applies to {' and '.join(CALIBRATED)}; {method} needs none")
        raise ConfigError(f"quantize {option} applies to {' and '.join(methods)} only, not to {method}; leave it out "
                          f"or quantize with --method {' or '.join(methods)}")


def method_scheme(method: str, options: QuantizeOptions) -> Scheme:
    """The storage scheme of `method`, refusing (ConfigError) options that do not apply to it."""
    check_method_options(method, options)
    if method in ("rtn", "gptq"):
        bits = DEFAULT_BITS if options.bits is None else options.bits
        if bits not in (4, 8):
            raise ConfigError(f"quantize --bits {bits} is invalid: {method} writes 4 or 8 bit weights")
        group = DEFAULT_GROUP if options.group_size is None else options.group_size
        return Scheme("int", bits, group or None, False, options.actorder)
    return Scheme("int" if method == "smoothquant" else "float", 8, None, True)


def check_model(cfg: ModelConfig, scheme: Scheme, method: str) -> None:
    """Refuse (ConfigError) a model part `method` does not quantize, or a group that does not fit."""
    if method in CALIBRATED and (cfg.moe is not None or cfg.mla is not None):
        part = "routed experts (MoE)" if cfg.moe is not None else "multi-head latent attention (MLA)"
        why = ("its calibration hooks see linear layers, not the experts' grouped product" if method == "gptq" else
               "its smoothing is folded into the dense attention and MLP only")
        raise ConfigError(f"quantize --method {method}: family {cfg.family!r} has {part}, which {method} does not "
                          f"quantize ({why}); quantize this model with --method rtn or fp8")
    if hf_fused_rows(cfg):
        raise ConfigError(f"quantize --method {method}: family {cfg.family!r} stores q, k, v and the MLP's gate and up "
                          "projections fused (qkv_proj, gate_up_proj), which the quantized directory's per-layer "
                          "scales do not split; serve or convert the full-precision model instead")
    if method == "smoothquant" and cfg.block_norms == "post":
        raise ConfigError(f"quantize --method smoothquant folds its scales into the RMSNorm before each projection; "
                          f"family {cfg.family!r} has none there (its norms follow attention and MLP); quantize this "
                          "model with --method gptq, rtn or fp8")
    g = scheme.group_size
    if g is None:
        return
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
    inputs = {}  # in_features -> the first layer that has it
    for name, m in quantizable_layers(model):
        widths = [m.in_features] if isinstance(m, nn.Linear) else [m.w1.shape[2], m.w2.shape[2]]
        for w in widths:
            inputs.setdefault(w, name)
    bad = {w: name for w, name in inputs.items() if w % g}
    if bad:
        raise ConfigError(f"quantize --group-size {g} does not divide the inputs of every linear layer "
                          f"({', '.join(f'{name} has {w}' for w, name in bad.items())}); give a common divisor, "
                          "or 0 for one scale per output channel")


def quantize(src: str | os.PathLike, dst: str | os.PathLike, method: str,
             options: QuantizeOptions = QuantizeOptions()) -> QuantizeResult:
    """Write `dst`, the HuggingFace model `src` quantized by `method` (module docstring)."""
    scheme = method_scheme(method, options)
    options = options.resolved()
    if not is_hf_directory(src):
        raise ConfigError(f"quantize: {str(src)!r} is not a HuggingFace model directory (no config.json); "
                          "convert a Tessera checkpoint first (tessera convert)")
    if "quantization_config" in read_json_object(Path(src) / "config.json"):
        raise ConfigError(f"quantize: {str(src)!r} is quantized already (its config.json has a "
                          "quantization_config); give the full-precision model")
    try:
        check_new_destination("quantize", src, dst)
    except CheckpointError as e:  # a destination the user named wrongly is bad input here
        raise ConfigError(str(e)) from None
    try:
        cfg = read_hf_config(src)
    except (ModelError, CheckpointError) as e:  # SRC is the command's input: naming another model is bad input
        raise ConfigError(f"quantize: {str(src)!r} is not a model Tessera can quantize: {e}") from None
    check_model(cfg, scheme, method)
    check_finite_weights("quantize", src, cfg)
    tokens = None
    if method in CALIBRATED:
        tokens, _ = load_calibration("quantize", src, cfg, options.calibration, options.num_sequences,
                                     options.seq_len)
    dtype = stored_dtype(read_json_object(Path(src) / "config.json"))
    model = load_pretrained(src, dtype=torch.float32)
    quantized = quantize_linears(model, method, scheme, dtype, options, tokens)
    write_compressed(model, quantized, scheme, dtype, Path(src), Path(dst))
    matrices = sum(len(q) if isinstance(q, list) else 1 for q in quantized.values())
    return QuantizeResult(Path(dst), scheme, sorted(quantized), matrices, 0 if tokens is None else tokens.numel())


@torch.no_grad()
def quantize_linears(model: Transformer, method: str, scheme: Scheme, dtype: torch.dtype, options: QuantizeOptions,
                     tokens: torch.Tensor | None) -> dict[str, QuantizedWeight | list[QuantizedWeight]]:
    """Every block linear layer of `model` quantized by `method` (scales in `dtype`), by module name;
    routed experts (rtn and fp8) by parameter name ("layers.1.moe.experts.w1"), one weight per
    expert. smoothquant smooths `model` in place first; gptq leaves the dequantized weights in it."""
    options = options.resolved()
    if method == "gptq":
        quantized: dict[str, QuantizedWeight | list[QuantizedWeight]] = {}

        def quantize_block(linears: dict[str, nn.Linear], stats) -> None:
            for name, m in linears.items():
                q = gptq_quantize(m.weight.to(dtype).float(), stats[name].hessian(), scheme, dtype,
                                  options.dampening, options.block_size)
                quantized[name] = q
                m.weight.copy_(q.dequantize().float())

        quantize_blocks(model, tokens, quantize_block)
        return quantized
    if method == "smoothquant":
        smooth(model, input_absmax(model, tokens), options.alpha)

    def one(w: torch.Tensor) -> QuantizedWeight:
        w = w.detach().to(dtype)
        return quantize_fp8(w, dtype) if method == "fp8" else quantize_int(w, scheme, dtype)

    out: dict[str, QuantizedWeight | list[QuantizedWeight]] = {}
    for name, m in quantizable_layers(model):
        if isinstance(m, nn.Linear):
            out[name] = one(m.weight)
        else:  # routed experts: [E, out, in] per projection
            out.update({f"{name}.{p}": [one(w) for w in getattr(m, p)] for p in ("w1", "w2", "w3")})
    return out
