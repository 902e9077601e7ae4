"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") in the
PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

For a targeted linear layer W (out x in) an adapter adds  y += s * B (A x),  A: r x in,
B: out x r, s = lora_alpha / r (or lora_alpha / sqrt(r) with rsLoRA, Kalajdzievski 2023).

- Static: `merge_adapter` folds s * B A into W at load time; serving is as fast as the base model.
- Dynamic: `LoRAManager` keeps several adapters resident and adds each token's adapter through a
  forward hook on the targeted modules, so one batch mixes requests of different adapters (and
  of none) (in the manner of S-LoRA, Sheng et al. 2023, without its custom kernels: one pair of
  small matmuls per adapter present in the batch). Adapters load and unload between steps.

An adapter directory is untrusted input: `adapter_config.json` is read bounded in size and
checked field by field (a wrong type, a missing or huge rank gets a CheckpointError naming the
field, never the file's text), its tensors must be finite, and at run time adapters load only
from inside the configured directories (`confined_adapter_dir`).

PEFT names modules as HuggingFace does (`model.layers.0.self_attn.q_proj`); the table
`tessera.checkpoint.hf.names.hf_names` maps them to Tessera's (`layers.0.attention.wq`). LoRA on
embeddings, on routed experts (stored as one [E, out, in] tensor here), DoRA and LoRA biases are
refused with a message naming the key.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from tessera.checkpoint.hf.names import hf_fused_rows, hf_names
from tessera.checkpoint.hf.peft import PREFIX
from tessera.checkpoint.patterns import file_pattern
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.json_text import parse_json
from tessera.models.int8 import Int8Linear
from tessera.models.quantized import Fp8Linear, Int4Linear
from tessera.models.stored_quant import StoredQuantLinear
from tessera.models.transformer import Transformer

_KEY = re.compile(rf"^{re.escape(PREFIX)}(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_REFUSED = ("lora_embedding_", "lora_magnitude_vector", "lora_bias", ".bias")


@dataclass
class AdapterWeights:
    A: torch.Tensor  # [r, in]
    B: torch.Tensor  # [out, r]
    scale: float


MAX_LORA_RANK = 4096  # far above any published adapter; a bigger rank is a broken or hostile config
MAX_CONFIG_BYTES = 1 << 20
_PATTERN_KEY = re.compile(r"^[A-Za-z0-9_.]+$")


def _pattern(key: str, field: str):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name ending in it (a regular
    expression, as PEFT reads it), run in linear time (tessera.checkpoint.patterns)."""
    return file_pattern(rf"(.*\.)?({key})$", f"adapter_config.json: {field} key {key[:200]!r}")


def _pattern_value(patterns: dict, field: str, module: str, default: float) -> float:
    for key, value in patterns.items():
        if _pattern(key, field).match(module):
            return value
    return default


def confined_adapter_dir(path: str, roots: Sequence[str | Path]) -> tuple[Path, Path]:
    """(adapter directory, the root holding it): `path` resolved through symlinks (a relative one
    inside each root in turn), if it lies inside one of `roots`. Otherwise ConfigError, with the
    same message whether or not the path exists, so the error tells nothing about other files."""
    resolved_roots = [Path(r).resolve() for r in roots]
    if os.path.isabs(path):
        resolved = Path(path).resolve()
        for root in resolved_roots:
            if resolved.is_relative_to(root):
                return resolved, root
    else:
        inside = [((root / path).resolve(), root) for root in resolved_roots]
        inside = [(d, root) for d, root in inside if d.is_relative_to(root)]
        for d, root in inside:
            if d.exists():
                return d, root
        if inside:
            return inside[0]
    raise ConfigError(f"lora_path {path[:200]!r} is not inside an adapter directory this server loads from "
                      "(--lora-modules-dir)")


def _confined_file(directory: Path, name: str, root: Path | None) -> Path:
    f = directory / name
    if not f.is_file():
        raise CheckpointError(f"{directory}: not a PEFT LoRA adapter ({name} is missing)")
    resolved = f.resolve()
    if root is not None and not resolved.is_relative_to(root):
        raise CheckpointError(f"{directory}: {name} links outside the adapter directories")
    return resolved


def _field_type(cfg: dict, key: str, types: tuple, what: str) -> None:
    if key in cfg and cfg[key] is not None and (not isinstance(cfg[key], types) or (
            isinstance(cfg[key], bool) and bool not in types)):
        raise CheckpointError(f"adapter_config.json: {key!r} must be {what}, got {type(cfg[key]).__name__}")


def _finite_number(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # a JSON integer too big for a float
        return False


def _rank_ok(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_LORA_RANK


def read_adapter_config(cfg_file: Path, untrusted: bool = True) -> dict:
    """adapter_config.json, parsed and checked; CheckpointError naming the field otherwise.
    `untrusted` (an adapter a client asked for): pattern keys must be plain module names."""
    with open(cfg_file, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = parse_json(raw, "adapter_config.json", CheckpointError)
    except CheckpointError:  # its message may quote the file (a key's name): say only where
        raise CheckpointError("adapter_config.json is not valid JSON (or holds text that is not Unicode)") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"adapter_config.json must hold a JSON object, got {type(cfg).__name__}")
    _field_type(cfg, "peft_type", (str,), "a string")
    if cfg.get("peft_type", "LORA") not in ("LORA", None):
        raise CheckpointError("adapter_config.json: 'peft_type' must be 'LORA' (only LoRA adapters are supported)")
    for flag in ("use_dora", "fan_in_fan_out", "use_rslora"):
        _field_type(cfg, flag, (bool,), "a boolean")
        if flag != "use_rslora" and cfg.get(flag):
            raise CheckpointError(f"adapter_config.json: {flag}=true is not supported")
    _field_type(cfg, "lora_alpha", (int, float), "a number")
    if cfg.get("lora_alpha") is not None and not _finite_number(cfg["lora_alpha"]):
        raise CheckpointError("adapter_config.json: 'lora_alpha' must be a finite number")
    if "r" not in cfg:
        raise CheckpointError("adapter_config.json: 'r' (the LoRA rank) is missing")
    if not _rank_ok(cfg["r"]):
        raise CheckpointError(f"adapter_config.json: 'r' must be an integer in 1..{MAX_LORA_RANK}")
    for key, check, what in (("rank_pattern", _rank_ok, f"integers in 1..{MAX_LORA_RANK}"),
                             ("alpha_pattern", _finite_number, "finite numbers")):
        _field_type(cfg, key, (dict,), "an object")
        for name, value in (cfg.get(key) or {}).items():
            if untrusted and (not _PATTERN_KEY.match(name) or len(name) > 256):
                raise CheckpointError(f"adapter_config.json: {key!r} keys must be module names (letters, digits, "
                                      "'_' and '.'); regular expressions are not supported")
            _pattern(name, key)  # a key that is no expression RE2 runs: refused before any weight is read
            if not check(value):
                raise CheckpointError(f"adapter_config.json: {key!r} values must be {what}")
    return cfg


def _linear_modules(model: Transformer) -> dict[str, str]:
    """HuggingFace module name -> Tessera module name, for every linear layer an adapter may target."""
    modules = dict(model.named_modules())
    out, fused = {}, hf_fused_rows(model.cfg)  # a fused projection (Phi-3's qkv_proj) spans several layers: none
    for key, hf_keys in hf_names(model.cfg).items():
        if key in fused or len(hf_keys) != 1 or not key.endswith(".weight") or not hf_keys[0].endswith(".weight"):
            continue
        name = key[: -len(".weight")]
        m = modules.get(name)
        if isinstance(m, nn.Linear | Int8Linear | Fp8Linear | Int4Linear | StoredQuantLinear):
            out[hf_keys[0][: -len(".weight")]] = name
    return out


def _lora_parts(path: Path, tensors: dict[str, torch.Tensor], targets: dict[str, str],
                modules: dict[str, nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    """HuggingFace module name -> {"A": lora_A, "B": lora_B} of the adapter's tensors; the copies of
    targeted base layers PEFT saves are checked against the served weights and dropped."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.endswith(".base_layer.weight"):  # PEFT saves a copy of a targeted head: it must be the base's
            hf_module = key.removeprefix(PREFIX).removesuffix(".base_layer.weight")
            base = modules.get(targets.get(hf_module, ""))
            if not isinstance(base, nn.Linear) or base.weight.shape != t.shape or not torch.allclose(
                    base.weight.float().cpu(), t.float(), atol=1e-6):
                raise CheckpointError(f"{path}: {key!r} differs from the served base weights; adapters that "
                                      "replace base layers are not supported")
            continue
        if any(r in key for r in _REFUSED):
            raise CheckpointError(f"{path}: tensor {key[:200]!r} is not supported (only lora_A/lora_B of linear "
                                  "layers)")
        m = _KEY.match(key)
        if m is None:
            raise CheckpointError(f"{path}: unexpected tensor name {key[:200]!r} (expected base_model.model."
                                  "<module>.lora_A.weight / .lora_B.weight)")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise CheckpointError(f"{path}: tensor {key[:200]!r} must hold finite floating-point numbers")
        parts.setdefault(m["module"], {})[m["part"]] = t
    return parts


def read_adapter(path: str | Path, model: Transformer, root: str | Path | None = None) -> dict[str, AdapterWeights]:
    """Tessera module name -> LoRA weights of the PEFT adapter in directory `path`. With `root`
    (an adapter a client asked for at run time) its files must resolve (through symlinks) inside
    `root` too, and its rank/alpha patterns must be plain module names."""
    path = Path(path)
    root = Path(root).resolve() if root is not None else None
    cfg_file = _confined_file(path, "adapter_config.json", root)
    weights_file = _confined_file(path, "adapter_model.safetensors", root)
    cfg = read_adapter_config(cfg_file, untrusted=root is not None)
    alpha = float(cfg["lora_alpha"] if cfg.get("lora_alpha") is not None else 8)
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: adapter_model.safetensors is not a readable safetensors file "
                              f"({type(e).__name__})") from None
    targets = _linear_modules(model)
    modules = dict(model.named_modules())
    parts = _lora_parts(path, tensors, targets, modules)
    out = {}
    for hf_module, ab in parts.items():
        if hf_module not in targets:
            raise CheckpointError(f"{path}: adapter targets {hf_module[:200]!r}, which is not a linear layer of this "
                                  f"{model.cfg.family} model (routed experts and embeddings are not supported)")
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{path}: {hf_module} has lora_{''.join(ab)} but needs both lora_A and lora_B")
        name = targets[hf_module]
        A, B = ab["A"].float(), ab["B"].float()
        w = modules[name]
        out_f, in_f = w.out_features, w.in_features
        if A.shape[1] != in_f or B.shape[0] != out_f or A.shape[0] != B.shape[1]:
            raise CheckpointError(f"{path}: {hf_module} lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not "
                                  f"fit a {out_f}x{in_f} layer")
        r = _pattern_value(rank_pattern, "rank_pattern", hf_module, cfg["r"])
        if r != A.shape[0]:
            raise CheckpointError(f"{path}: {hf_module} has rank {A.shape[0]} but adapter_config.json gives r={r}")
        a = _pattern_value(alpha_pattern, "alpha_pattern", hf_module, alpha)
        out[name] = AdapterWeights(A, B, a / (math.sqrt(r) if rslora else r))
    if not out:
        raise CheckpointError(f"{path}: the adapter has no LoRA weights")
    return out


@torch.no_grad()
def merge_adapter(model: Transformer, path: str | Path) -> None:
    """Static LoRA: W += s * B A for every adapted layer of `model` (in place)."""
    modules = dict(model.named_modules())
    for name, w in read_adapter(path, model).items():
        m = modules[name]
        if not isinstance(m, nn.Linear):
            raise ConfigError(f"cannot merge LoRA into quantized layer {name}; merge before quantizing")
        m.weight += (w.scale * (w.B @ w.A)).to(m.weight.dtype)


@dataclass
class LoadedAdapter:
    name: str
    path: str
    slot: int
    key: bytes  # prefix-cache identity: changes whenever weights under this name change
    modules: list[str]


class LoRAManager:
    """Resident dynamic adapters and the forward hooks that apply them per token."""

    def __init__(self, model: Transformer, max_loras: int, dtype: torch.dtype, device: torch.device | str):
        self.model, self.max_loras, self.dtype, self.device = model, max_loras, dtype, device
        self.adapters: dict[str, LoadedAdapter] = {}
        self.weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}  # module -> slot -> A, B, s
        self._hooks: dict[str, object] = {}
        self._modules = dict(model.named_modules())
        self._uids = itertools.count()
        self._rows: list[tuple[int, torch.Tensor]] | None = None  # this step's (slot, packed rows)

    def load(self, name: str, path: str | Path, weights: dict[str, AdapterWeights] | None = None) -> LoadedAdapter:
        """Make adapter `name` resident; `weights` is `read_adapter(path, model)` when the caller
        has already read it (off the engine thread)."""
        if not name or name in self.adapters:
            raise ConfigError(f"lora name {name[:200]!r} is empty or already loaded; unload it first")
        if len(self.adapters) >= self.max_loras:
            raise ConfigError(f"already {self.max_loras} adapters loaded (max_loras); unload one first")
        if weights is None:
            weights = read_adapter(path, self.model)
        used = {a.slot for a in self.adapters.values()}
        slot = next(i for i in range(self.max_loras) if i not in used)
        for module, w in weights.items():
            A, B = w.A.to(self.device, self.dtype), w.B.to(self.device, self.dtype)
            self.weights.setdefault(module, {})[slot] = (A, B, w.scale)
            if module not in self._hooks:
                self._hooks[module] = self._modules[module].register_forward_hook(self._hook(module))
        adapter = LoadedAdapter(name, str(path), slot, f"{name}#{next(self._uids)}".encode(), sorted(weights))
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise ConfigError(f"lora {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        for module in adapter.modules:
            self.weights[module].pop(adapter.slot, None)
            if not self.weights[module]:
                del self.weights[module]
                self._hooks.pop(module).remove()

    def set_batch(self, slots_and_counts: list[tuple[int, int]], device: torch.device | str) -> None:
        rows: dict[int, list[int]] = {}
        t = 0
        for slot, count in slots_and_counts:
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(t, t + count))
            t += count
        self._rows = [(s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in rows.items()]

    def clear_batch(self) -> None:
        self._rows = None

    def _hook(self, module: str):
        def add_lora(_mod: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            if not self._rows:
                return output
            x = inputs[0]  # [1, T, in]
            by_slot = self.weights.get(module, {})
            for slot, rows in self._rows:
                w = by_slot.get(slot)
                if w is None:
                    continue
                A, B, s = w
                delta = (x[:, rows] @ A.T) @ B.T * s  # [1, n, out]
                output = output.index_add(1, rows, delta.to(output.dtype))
            return output
        return add_lora
