"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") in the
PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

For a targeted linear layer W (out x in) an adapter adds  y += s * B (A x),  A: r x in,
B: out x r, s = lora_alpha / r (or lora_alpha / sqrt(r) with rsLoRA, Kalajdzievski 2023).

- Static: `merge_adapter` folds s * B A into W at load time; serving is as fast as the base model.
- Dynamic: `LoRAManager` keeps several adapters resident and adds each token's adapter through a
  forward hook on the targeted modules, so one batch mixes requests of different adapters (and
  of none) (in the manner of S-LoRA, Sheng et al. 2023, without its custom kernels: one pair of
  small matmuls per adapter present in the batch). Adapters load and unload between steps.

PEFT names modules as HuggingFace does (`model.layers.0.self_attn.q_proj`); the table
`tessera.checkpoint.hf_weights.hf_names` maps them to Tessera's (`layers.0.attention.wq`). LoRA on
embeddings, on routed experts (stored as one [E, out, in] tensor here), DoRA and LoRA biases are
refused with a message naming the key.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from tessera.checkpoint.hf_weights import hf_names
from tessera.config.errors import CheckpointError, ConfigError
from tessera.models.transformer import Transformer

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_REFUSED = ("lora_embedding_", "lora_magnitude_vector", "lora_bias", ".bias")


@dataclass
class AdapterWeights:
    A: torch.Tensor  # [r, in]
    B: torch.Tensor  # [out, r]
    scale: float


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name ending in it (regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _linear_modules(model: Transformer) -> dict[str, str]:
    """HuggingFace module name -> Tessera module name, for every linear layer an adapter may target."""
    modules = dict(model.named_modules())
    out = {}
    for key, hf_keys in hf_names(model.cfg).items():
        if len(hf_keys) != 1 or not key.endswith(".weight") or not hf_keys[0].endswith(".weight"):
            continue
        name = key[: -len(".weight")]
        m = modules.get(name)
        if isinstance(m, nn.Linear) or getattr(m, "is_quantized_linear", False):
            out[hf_keys[0][: -len(".weight")]] = name
    return out


def read_adapter(path: str | Path, model: Transformer) -> dict[str, AdapterWeights]:
    """Tessera module name -> LoRA weights of the PEFT adapter in directory `path`."""
    path = Path(path)
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise CheckpointError(f"{path}: not a PEFT LoRA adapter ({f.name} is missing)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type={cfg.get('peft_type')!r}; only LORA adapters are supported")
    for flag in ("use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise CheckpointError(f"{path}: {flag}=true is not supported")
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    tensors = load_file(str(weights_file))
    targets = _linear_modules(model)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    modules = dict(model.named_modules())
    for key, t in tensors.items():
        if key.endswith(".base_layer.weight"):  # PEFT saves a copy of a targeted head: it must be the base's
            hf_module = key.removeprefix("base_model.model.").removesuffix(".base_layer.weight")
            base = modules.get(targets.get(hf_module, ""))
            if not isinstance(base, nn.Linear) or base.weight.shape != t.shape or not torch.allclose(
                    base.weight.float().cpu(), t.float(), atol=1e-6):
                raise CheckpointError(f"{path}: {key!r} differs from the served base weights; adapters that "
                                      "replace base layers are not supported")
            continue
        if any(r in key for r in _REFUSED):
            raise CheckpointError(f"{path}: tensor {key!r} is not supported (only lora_A/lora_B of linear layers)")
        m = _KEY.match(key)
        if m is None:
            raise CheckpointError(f"{path}: unexpected tensor name {key!r} (expected base_model.model.<module>"
                                  ".lora_A.weight / .lora_B.weight)")
        parts.setdefault(m["module"], {})[m["part"]] = t
    out = {}
    for hf_module, ab in parts.items():
        if hf_module not in targets:
            raise CheckpointError(f"{path}: adapter targets {hf_module!r}, which is not a linear layer of this "
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
        r = _pattern_value(rank_pattern, hf_module, A.shape[0])
        a = _pattern_value(alpha_pattern, hf_module, alpha)
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

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        if not name or name in self.adapters:
            raise ConfigError(f"lora name {name!r} is empty or already loaded; unload it first")
        if len(self.adapters) >= self.max_loras:
            raise ConfigError(f"already {self.max_loras} adapters loaded (max_loras); unload one first")
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
