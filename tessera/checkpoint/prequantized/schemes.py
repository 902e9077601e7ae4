"""What a HuggingFace directory's `quantization_config` says, turned into a layer for each linear.

Two methods are read; anything else is refused by name with what is allowed (ConfigError: the
directory is well-formed, but asks for what Tessera does not run, so the CLI exits 2):

- `quant_method: "compressed-tensors"` (llm-compressor's output): `config_groups`, each a scheme
  (`weights`, `input_activations`, `targets`, `format`, or the config's top-level `format`), and
  `ignore`. A module is quantized by the first group one of whose targets matches it ("Linear",
  an exact module name, or "re:PATTERN" matched at the start of the name) unless an `ignore` entry
  matches it. Formats: `pack-quantized` (int4 / int8 weights, per group, channel or tensor,
  symmetric or with zero points, activation order by `weight_g_idx`; no activation quantization),
  `int-quantized` (int8 weights per channel or tensor; int8 activations per token dynamic or per
  tensor static / dynamic) and `float-quantized` (e4m3 weights per channel, tensor or block;
  e4m3 activations per token or group dynamic, or per tensor static / dynamic).
- `quant_method: "fp8"` with `weight_block_size` (DeepSeek-V3's block-wise FP8): e4m3 weights
  with `weight_scale_inv` per block; activations (`activation_scheme: "dynamic"`) stay in full
  precision, as transformers' dequantizing FP8 path computes them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from tessera.checkpoint.patterns import file_pattern
from tessera.config.errors import CheckpointError, ConfigError
from tessera.models.stored_quant import (
    ActivationQuant,
    BlockFp8Linear,
    FloatQuantizedLinear,
    IntQuantizedLinear,
    PackedIntLinear,
)

METHODS = ("compressed-tensors", "fp8")
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
FORMAT_TYPES = {"int-quantized": "int", "float-quantized": "float"}  # the weights' `type` each format stores
Factory = Callable[..., object]  # (in_features, out_features, bias, dtype) -> StoredQuantLinear


def _need(ok: bool, source: str, what: str, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{source}: {what} is not supported; Tessera loads {allowed}")


def _activation(args: dict | None, source: str) -> ActivationQuant | None:
    """The input-activation scheme of a compressed-tensors group (None: activations not quantized)."""
    if args is None:
        return None
    kind, strategy, dynamic = args.get("type", "int"), args.get("strategy"), args.get("dynamic", False)
    _need(args.get("num_bits") == 8 and kind in ("int", "float"), source,
          f"input_activations num_bits={args.get('num_bits')} type={kind!r}", "8-bit int or float activations")
    _need(args.get("symmetric", True) is True, source, "asymmetric input_activations", "symmetric activations")
    _need(dynamic in (True, False), source, f"input_activations dynamic={dynamic!r}", "dynamic true or false")
    allowed = {("token", True), ("tensor", True), ("tensor", False)} | ({("group", True)} if kind == "float" else set())
    _need((strategy, dynamic) in allowed, source, f"input_activations strategy={strategy!r} dynamic={dynamic}",
          "activations per token (dynamic), per tensor (static or dynamic)"
          + (" or per group (dynamic)" if kind == "float" else ""))
    return ActivationQuant(kind, strategy, bool(dynamic), args.get("group_size"))


def _packed(w: dict, in_features: int, source: str, g_idx: bool) -> dict:
    strategy, bits, gs = w.get("strategy"), w.get("num_bits"), w.get("group_size")
    _need(bits in (4, 8) and w.get("type", "int") == "int", source, f"pack-quantized weights num_bits={bits}",
          "4- or 8-bit integer weights")
    _need(strategy in ("group", "channel", "tensor"), source, f"pack-quantized weight strategy={strategy!r}",
          "group, channel or tensor")
    if strategy == "group":
        _need(isinstance(gs, int) and gs > 0 and in_features % gs == 0, source,
              f"group_size={gs!r} for in_features={in_features}", "groups that divide the input features")
    symmetric = w.get("symmetric", True) is not False
    _need(symmetric or strategy != "tensor", source, "asymmetric per-tensor pack-quantized weights",
          "zero points per group or channel")
    groups = in_features // gs if strategy == "group" else (1 if strategy == "channel" else 0)
    return dict(num_bits=bits, groups=groups, group_size=gs if strategy == "group" else None, symmetric=symmetric,
                g_idx=g_idx)


def ct_factory(group: dict, fmt: str | None, in_features: int, source: str, g_idx: bool) -> Factory:
    """The layer one compressed-tensors scheme stores a linear of `in_features` inputs as."""
    w = group.get("weights")
    _need(isinstance(w, dict), source, "a scheme without weight quantization", "schemes that quantize weights")
    _need(group.get("output_activations") is None, source, "output_activations quantization",
          "weight and input-activation quantization only")
    _need(fmt in FORMATS, source, f"format {fmt!r}", f"formats {', '.join(FORMATS)}")
    act = _activation(group.get("input_activations"), source)
    kind, strategy = w.get("type", "int"), w.get("strategy")
    if fmt == "pack-quantized":
        _need(act is None, source, "pack-quantized with input_activations", "pack-quantized weight-only (W4A16, W8A16)")
        return partial(PackedIntLinear, **_packed(w, in_features, source, g_idx))
    _need(w.get("num_bits") == 8, source, f"{fmt} weights num_bits={w.get('num_bits')}", "8-bit weights")
    _need(FORMAT_TYPES.get(fmt, kind) == kind, source, f"format {fmt} with weights type={kind!r}",
          "float-quantized formats of float (e4m3) weights and int-quantized ones of int8 weights")
    if kind == "int":
        _need(strategy in ("channel", "tensor"), source, f"int8 weight strategy={strategy!r}", "channel or tensor")
        return partial(IntQuantizedLinear, per_channel=strategy == "channel",
                       symmetric=w.get("symmetric", True) is not False, act=act)
    _need(kind == "float", source, f"weights type={kind!r}", "int or float weights")
    _need(w.get("symmetric", True) is not False, source, "asymmetric fp8 weights", "symmetric fp8 weights")
    if strategy == "block":
        block = w.get("block_structure")
        _need(isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
              source, f"block_structure={block!r}", "[rows, cols] of positive ints")
        return partial(BlockFp8Linear, block=tuple(block), scale_name="weight_scale", act=act)
    _need(strategy in ("channel", "tensor"), source, f"fp8 weight strategy={strategy!r}", "channel, tensor or block")
    return partial(FloatQuantizedLinear, per_channel=strategy == "channel", act=act)


def _matchers(targets: object, where: str) -> list[Callable[[str], bool]]:
    """A compressed-tensors target list (`targets`, `ignore`) as one test per entry: "Linear" (every
    candidate is a linear layer), "re:PATTERN" (matched at the start of the name, in linear time:
    tessera.checkpoint.patterns) or an exact module name. CheckpointError naming the key otherwise."""
    if targets is None:
        return []
    if not isinstance(targets, list):
        raise CheckpointError(f"{where} must be a list of module names or 're:' patterns, got "
                              f"{type(targets).__name__}")
    tests = []
    for i, target in enumerate(targets):
        if not isinstance(target, str):
            raise CheckpointError(f"{where}[{i}] must be a string, got {type(target).__name__}")
        if target == "Linear":
            tests.append(lambda name: True)
        elif target.startswith("re:"):
            tests.append(partial(_regex_match, file_pattern(target.removeprefix("re:"), f"{where}[{i}]")))
        else:
            tests.append(target.__eq__)
    return tests


def _regex_match(regex, name: str) -> bool:
    return regex.match(name) is not None


class QuantizationPlan:
    """Which HuggingFace linear modules (names without `.weight`) are stored quantized, and as what."""

    def __init__(self, qc: dict, source: str):
        self.source = source
        method = qc.get("quant_method")
        _need(method in METHODS, source, f"quantization_config.quant_method={method!r}",
              f"pre-quantized checkpoints with quant_method {' or '.join(map(repr, METHODS))}")
        self.method = method
        self.block = self.groups = None
        self.ignore: list[Callable[[str], bool]] = []
        self.targets: dict[str, list[Callable[[str], bool]]] = {}
        if method == "fp8":
            self._fp8(qc)
        else:
            self._compressed_tensors(qc)

    def _fp8(self, qc: dict) -> None:
        block = qc.get("weight_block_size")
        _need(isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
              self.source, f"fp8 weight_block_size={block!r}", "block-wise FP8 (weight_block_size [rows, cols])")
        _need(qc.get("activation_scheme", "dynamic") == "dynamic", self.source,
              f"activation_scheme={qc.get('activation_scheme')!r}", "activation_scheme 'dynamic'")
        _need(qc.get("fmt", "e4m3") == "e4m3", self.source, f"fmt={qc.get('fmt')!r}", "fmt 'e4m3'")
        self.block = tuple(block)  # modules_to_not_convert need no list: they are stored without weight_scale_inv

    def _compressed_tensors(self, qc: dict) -> None:
        status = qc.get("quantization_status", "compressed")
        _need(status == "compressed", self.source, f"quantization_status={status!r}",
              "compressed checkpoints (quantization_status 'compressed')")
        for key, what in (("sparsity_config", "sparsity (e.g. 2:4)"), ("transform_config", "transforms"),
                          ("kv_cache_scheme", "KV-cache quantization (kv_cache_scheme)")):
            _need(not qc.get(key), self.source, what, "weight and activation quantization of linear layers only")
        groups = qc.get("config_groups")
        _need(isinstance(groups, dict) and bool(groups), self.source, "a quantization_config without config_groups",
              "compressed-tensors configs with config_groups")
        where = f"{self.source}: config.json quantization_config"
        for name, group in groups.items():
            if not isinstance(group, dict):
                raise CheckpointError(f"{where}.config_groups.{name} must be an object, got {type(group).__name__}")
            self.targets[name] = _matchers(group.get("targets"), f"{where}.config_groups.{name}.targets")
        self.groups = groups
        self.format = qc.get("format")
        self.ignore = _matchers(qc.get("ignore"), f"{where}.ignore")

    def factory(self, hf_name: str, in_features: int, stored: set[str]) -> Factory | None:
        """The layer HuggingFace linear `hf_name` loads as, or None when it is stored full precision."""
        source = f"{self.source} ({hf_name})"
        if self.method == "fp8":
            if f"{hf_name}.weight_scale_inv" not in stored:
                return None
            return partial(BlockFp8Linear, block=self.block, scale_name="weight_scale_inv")
        if any(test(hf_name) for test in self.ignore):
            return None
        for name, group in self.groups.items():
            if any(test(hf_name) for test in self.targets[name]):
                return ct_factory(group, group.get("format") or self.format, in_features, source,
                                  f"{hf_name}.weight_g_idx" in stored)
        return None
