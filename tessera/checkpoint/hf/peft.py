"""A LoRA run's checkpoint (train.lora, tessera.config.training.lora) as a PEFT adapter directory, or merged into
a HuggingFace directory: `tessera convert RUN OUT --lora-adapter` / `--merge-lora`.

    write_peft_adapter("runs/sft-lora", "out/adapter")          # adapter_config.json + adapter_model.safetensors
    write_merged_lora("runs/sft-lora", "out/merged")            # config.json + safetensors: W + s B A

The adapter directory is what `peft.PeftModel.from_pretrained(base, DIR)` loads over the HuggingFace
base (`train.init_from`), what vLLM's LoRA loader reads and `tessera serve BASE --lora NAME=DIR` serves
(tessera.infer.runner.lora reads the same names): PEFT's names, `base_model.model.` + the HuggingFace
module (the family registry's, tessera.config.training.lora.lora_targets) + `.lora_A.weight` / `.lora_B.weight`,
and a module of `modules_to_save` under its HuggingFace name, as `PeftModel.save_pretrained` writes
them. `target_modules` lists the short names the run adapted (never `all-linear`, which PEFT would
also apply to layers the run left alone, such as routed experts). Only the adapters' tensors are read
from the checkpoint (whatever layout saved it), never the base.

The merged directory holds W + s B A for every adapted layer, in `dtype`, through `save_pretrained`:
the base weights are read from the checkpoint (the whole model is loaded; a quantized base,
QLoRA's, is dequantized first: what the run trained over).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.model import stored_model_config, stored_run_config
from tessera.checkpoint.hf.names import check_exportable, hf_names
from tessera.config.dataclass_build import build_dataclass
from tessera.config.errors import CheckpointError
from tessera.config.model import ModelConfig
from tessera.config.training.lora import SAVED_MODULES, LoRAConfig, lora_targets
from tessera.models.lora import FACTORS, adapted_layers, add_adapters, merged_delta
from tessera.models.quantized import quantize_model
from tessera.models.transformer import Transformer

PREFIX = "base_model.model."  # PEFT's prefix of every tensor of an adapter directory
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MODEL_PREFIX = "model."  # training checkpoints keep the weights under "model"


def stored_lora(path: str | os.PathLike) -> LoRAConfig:
    """train.lora of the run that saved checkpoint `path` (off for a run without adapters)."""
    raw = (stored_run_config(path).get("train") or {}).get("lora") or {}
    return build_dataclass(LoRAConfig, raw, "train.lora.")


def peft_tensor_names(cfg: ModelConfig, lora: LoRAConfig) -> dict[str, str]:
    """Tessera key -> PEFT key of every tensor an adapter directory of `lora` over model `cfg` holds."""
    names = {f"{module}.{factor}.weight": f"{PREFIX}{hf_module}.{factor}.weight"
             for module, hf_module in lora_targets(cfg, lora).items() for factor in FACTORS}
    hf = hf_names(cfg)
    for saved in lora.modules_to_save:
        key = f"{SAVED_MODULES[saved]}.weight"
        names[key] = PREFIX + hf[key][0]
    return names


def adapter_config(cfg: ModelConfig, lora: LoRAConfig, base: str | None) -> dict[str, Any]:
    """adapter_config.json of `lora` over model `cfg` (PEFT's fields; `base` is the HuggingFace base)."""
    targets = sorted({hf.rsplit(".", 1)[1] for hf in lora_targets(cfg, lora).values()})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": float(lora.alpha if lora.alpha is not None else lora.rank), "lora_dropout": lora.dropout,
            "use_rslora": lora.rslora, "target_modules": targets, "modules_to_save": list(lora.modules_to_save) or None,
            "bias": "none", "fan_in_fan_out": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None}


def _lora_run(found: Path) -> tuple[ModelConfig, LoRAConfig]:
    cfg, lora = stored_model_config(found), stored_lora(found)
    if not lora.enabled:
        raise CheckpointError(f"checkpoint {str(found)!r} was trained without train.lora: it has no adapter; convert "
                              "it without --lora-adapter / --merge-lora")
    return cfg, lora


def write_peft_adapter(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                       dtype: torch.dtype = torch.float32) -> Path:
    """The adapters of a LoRA run's checkpoint (saved under any layout) as a PEFT directory `out_dir`
    (new or empty), in `dtype`; only their tensors are read."""
    found = ckpt.verified(ckpt.resolve_checkpoint(checkpoint))
    cfg, lora = _lora_run(found)
    names = peft_tensor_names(cfg, lora)
    stored = ckpt.checkpoint_tensor_shapes(found)
    missing = [k for k in names if MODEL_PREFIX + k not in stored]
    if missing:
        raise CheckpointError(f"checkpoint {str(found)!r} does not hold the adapter its run describes: no "
                              f"{missing[0]!r}")
    boxes = {MODEL_PREFIX + k: ((0,) * len(stored[MODEL_PREFIX + k]), torch.empty(stored[MODEL_PREFIX + k]))
             for k in names}
    ckpt.load_boxes(found, boxes)
    tensors = {names[k]: boxes[MODEL_PREFIX + k][1].to(dtype).contiguous() for k in names}
    base = (stored_run_config(found).get("train") or {}).get("init_from")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        (out / CONFIG_FILE).write_text(json.dumps(adapter_config(cfg, lora, base), indent=2) + "\n")
    except OSError as e:
        raise CheckpointError(f"cannot write {str(out_dir)!r}: {e.strerror or e}") from e
    return out


def lora_model(checkpoint: str | os.PathLike) -> Transformer:
    """The model of a LoRA run's checkpoint as it trained (quantized base and adapters), on the CPU in fp32."""
    found = ckpt.verified(ckpt.resolve_checkpoint(checkpoint))
    cfg, lora = _lora_run(found)
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
        if lora.quantize_base is not None:
            quantize_model(model, lora.quantize_base)
        add_adapters(model, list(lora_targets(cfg, lora)), lora.rank, lora.scaling,
                     trained_whole=[SAVED_MODULES[n] for n in lora.modules_to_save])
    from tessera.checkpoint.dcp.shards import load_checkpoint_shards  # torch's DCP: only when a checkpoint loads

    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    load_checkpoint_shards([model], found, shapes, "cpu")
    return model.eval()


@torch.no_grad()
def merged_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The state of the plain model `model` computes (the adapters merged, a quantized base dequantized)."""
    with torch.device("meta"):
        plain = Transformer(model.cfg, init_seed=None)
    adapted = adapted_layers(model)
    own = model.state_dict()
    out = {}
    for key in plain.state_dict():
        module_name, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if key in own and module_name not in adapted:
            out[key] = own[key]
            continue
        weight = base_weight(module, leaf)
        if module_name in adapted and leaf == "weight":
            weight = weight + merged_delta(module.lora_A.weight, module.lora_B.weight, module.lora_scaling)
        out[key] = weight
    return out


def base_weight(module: torch.nn.Module, leaf: str) -> torch.Tensor:
    """fp32 weight `leaf` of a linear layer or routed experts, plain or quantized (dequantized)."""
    if isinstance(getattr(module, leaf, None), torch.Tensor):
        return getattr(module, leaf).float()
    if hasattr(module, "_weight"):  # quantized routed experts: w1 / w2 / w3
        return module._weight(leaf, torch.float32)
    if hasattr(module, "dequantized_weight"):  # fp8 / int4 linear layers
        return module.dequantized_weight(torch.float32)
    return module.qweight.float() * module.scale[:, None]  # int8 linear layers


def write_merged_lora(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      tokenizer=None) -> Path:
    """A LoRA run's model with its adapters merged, as a HuggingFace directory `out_dir` in `dtype`,
    with `tokenizer` (as `save_pretrained` takes it)."""
    from tessera.checkpoint.hf.writer import save_pretrained

    model = lora_model(checkpoint)
    check_exportable(model.cfg)
    with torch.device("meta"):
        plain = Transformer(model.cfg, init_seed=None)
    plain.to_empty(device="cpu")
    plain.load_state_dict(merged_state(model))
    plain.reset_rope("cpu")
    try:
        save_pretrained(plain.cast(dtype), out_dir, tokenizer=tokenizer)
    except OSError as e:
        raise CheckpointError(f"cannot write {str(out_dir)!r}: {e.strerror or e}") from e
    return Path(out_dir)
