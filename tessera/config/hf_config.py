"""HuggingFace `config.json` <-> `ModelConfig` for the supported families (tessera/config/families).

`read_hf_config(dir)` checks the file as untrusted input (JSON object, required fields, field types;
every problem one CheckpointError naming the file) and builds the `ModelConfig`; the run
configuration's `model.from_hf` and every HuggingFace loader use it. The family named by
`model_type` maps the fields; it reads both the legacy keys (`rope_theta`, `rope_scaling`) and
transformers 5's `rope_parameters`, and writes the legacy keys, which every transformers release reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tessera.config.errors import CheckpointError, ConfigError, ModelError
from tessera.config.families import REGISTRY
from tessera.config.families.base import INT_FIELDS, NUMBER_FIELDS
from tessera.config.json_text import read_json_file
from tessera.config.model import ModelConfig

SUPPORTED = {name: family.architecture for name, family in REGISTRY.items()}  # model_type -> transformers class

# config.json fields read as integers / numbers (when present), by any family; a string or a float
# where an integer belongs would otherwise fail deep inside model construction.
_INT_FIELDS = tuple(dict.fromkeys(INT_FIELDS + tuple(k for f in REGISTRY.values() for k in f.int_fields)))
_NUMBER_FIELDS = tuple(dict.fromkeys(NUMBER_FIELDS + tuple(k for f in REGISTRY.values() for k in f.number_fields)))
# (num_hidden_layers too, where the family reads it: Nemotron-H's count is its layers_block_type's length)
_REQUIRED = ("model_type", "vocab_size", "hidden_size", "num_attention_heads")


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError if it cannot be read, parsed, or is not an object."""
    data = read_json_file(path, CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(path)!r} holds a JSON {type(data).__name__}; a JSON object was expected")
    return data


def check_config_fields(d: dict[str, Any], source: Path) -> None:
    """Refuse a config.json whose required fields are missing or whose fields have the wrong type."""
    for key in _REQUIRED:
        if d.get(key) is None:
            raise CheckpointError(f"{str(source)!r}: required field {key!r} is missing")
    for key in _INT_FIELDS:
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CheckpointError(f"{str(source)!r}: {key}={value!r} is invalid: must be an integer")
    for key in _NUMBER_FIELDS:
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise CheckpointError(f"{str(source)!r}: {key}={value!r} is invalid: must be a number")


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a HuggingFace config dict, by its family (tessera/config/families);
    refuses what Tessera cannot reproduce."""
    family = REGISTRY.get(d.get("model_type"))
    if family is None:
        raise ModelError(f"unsupported architecture model_type={d.get('model_type')!r} ({d.get('architectures')}); "
                         f"supported: {', '.join(SUPPORTED)}")
    return ModelConfig(**family.config_from_hf(d))


def is_hf_directory(path: str | os.PathLike) -> bool:
    """A HuggingFace model directory is one with a config.json (what else it must hold is checked on load)."""
    return (Path(path) / "config.json").is_file()


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of HuggingFace model directory `path`, from its config.json (checked)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json (not a HuggingFace model directory)")
    d = read_json_object(cfg_file)
    check_config_fields(d, cfg_file)
    try:
        cfg = config_from_hf(d)
        cfg.mtp_depth = stored_mtp_depth(Path(path), d, cfg.n_layers) if REGISTRY[cfg.family].mtp_layers else 0
        cfg.validate()
        return cfg
    except ModelError:  # an architecture Tessera does not reproduce: already names the field
        raise
    except ConfigError as e:  # values that do not fit together: a bad file, not a bad command line
        raise CheckpointError(f"{str(cfg_file)!r}: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{str(cfg_file)!r}: required field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{str(cfg_file)!r}: a field has the wrong type ({e})") from e


def read_language_model_config(path: str | os.PathLike) -> ModelConfig:
    """`read_hf_config`, except that a LLaVA, Qwen2-VL or Qwen2.5-VL directory gives its language
    model's config: what `model.from_hf`, `train.init_from` and a distillation teacher read of it
    (the weights come from the same directory, `tessera.checkpoint.hf.slices`). A Qwen2-VL language
    model read alone is a qwen2 decoder: on text its M-RoPE positions are plain positions."""
    from tessera.config.vision_families import is_vision_language_config, read_vision_language_file

    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        d = read_json_object(cfg_file)
        if is_vision_language_config(d):
            return read_vision_language_file(d, str(cfg_file)).text
    return read_hf_config(path)


MAX_SAFETENSORS_HEADER = 100_000_000  # bytes; the safetensors format's own limit


def stored_mtp_depth(path: Path, d: dict[str, Any], n_layers: int) -> int:
    """DeepSeek-V3's multi-token-prediction layers (`num_nextn_predict_layers`, the layers after
    the last decoder layer) that the directory's weights hold: all of them, or 0 when the files
    lack them (transformers drops those layers and writes the field anyway)."""
    depth = d.get("num_nextn_predict_layers") or 0
    if not depth:
        return 0
    names = _stored_tensor_names(path)
    wanted = {f"model.layers.{n_layers + k}.eh_proj.weight" for k in range(depth)}
    return depth if wanted <= names else 0


def _stored_tensor_names(path: Path) -> set[str]:
    """The tensor names of a directory's safetensors: the index's, else each file's header."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        return set(weight_map) if isinstance(weight_map, dict) else set()
    names: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                head = fh.read(8)
                size = int.from_bytes(head, "little") if len(head) == 8 else 0
                header = json.loads(fh.read(size)) if 0 < size <= MAX_SAFETENSORS_HEADER else {}
        except (OSError, ValueError):  # a damaged file: the loader names it when it reads the weights
            continue
        if isinstance(header, dict):
            names.update(k for k in header if k != "__metadata__")
    return names


# Fields that decide the weights' shapes (nested ones dotted; a whole `moe` / `mla` section present in
# one model only counts too): the ones a shape mismatch is about.
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "tie_embeddings",
                "qkv_bias", "out_bias", "qk_norm", "moe", "moe.num_experts", "moe.ffn_dim", "moe.shared_ffn_dim",
                "moe.shared_expert_gate", "moe.first_k_dense", "moe.dense_layers", "moe.layer_freq",
                "moe.expert_bias", "mla", "mla.q_lora_rank", "mla.kv_lora_rank", "mla.qk_nope_head_dim",
                "mla.qk_rope_head_dim", "mla.v_head_dim", "linear_attention", "linear_attention.layers",
                "attention_output_gate", "sublayers", "mamba", "mamba.n_heads", "mamba.head_dim", "mamba.state_size",
                "mamba.n_groups", "mamba.conv_width", "mamba.conv_bias", "mamba.proj_bias", "activation")


def model_differences(mine: ModelConfig, theirs: ModelConfig, shapes_only: bool = False) -> list[str]:
    """'field (A here, B there)' for every field (nested ones dotted) where two models differ, or
    only for those that decide weight shapes (SHAPE_FIELDS)."""
    def walk(a: Any, b: Any, key: str) -> list[tuple[str, str]]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in sorted(a.keys() | b.keys()) for d in walk(a.get(k), b.get(k), f"{key}.{k}".lstrip("."))]
        return [] if a == b else [(key, f"{key} ({a!r} here, {b!r} there)")]
    return [text for key, text in walk(mine.to_dict(), theirs.to_dict(), "") if not shapes_only or key in SHAPE_FIELDS]


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HuggingFace config dict of the family recorded in `cfg.family`."""
    return REGISTRY[cfg.family].config_to_hf(cfg)
