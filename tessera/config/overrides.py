"""Command-line overrides `--set a.b=c` applied to a raw (YAML-loaded) configuration dictionary.

Values are parsed as YAML scalars, so `--set train.steps=10` gives the integer 10,
`--set train.init_from=null` gives None and `--set optim.betas=[0.9,0.95]` a list. Whether the
key exists and the value has the right type is checked later, when the dataclass tree is built
(`tessera.config.schema`), so an override and a YAML line fail with the same message.
"""

from __future__ import annotations

from typing import Any

import yaml

from tessera.config.errors import ConfigError
from tessera.config.yaml_text import load_yaml


def parse_value(text: str, key: str = "value") -> Any:
    """A YAML scalar (or flow list/dict); text that is not valid YAML stays a string.

    Read as strictly as a config file (`tessera.config.yaml_text`): duplicate keys, aliases that
    expand past the bound and over-deep nesting are a `ConfigError` naming `key`."""
    try:
        return load_yaml(text, f"override {key}")
    except yaml.YAMLError:
        return text


def parse_override(item: str) -> tuple[list[str], Any]:
    """`"a.b=c"` -> (["a", "b"], parsed c)."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} is malformed: expected KEY=VALUE with a dotted key, "
                          "e.g. train.steps=10")
    return key.split("."), parse_value(value, key)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted key of `overrides` in a copy of the nested dictionary `raw`.

    Missing intermediate sections are created; setting a key below a value that is not a section
    (e.g. `train.steps.x=1`) is an error naming the key.
    """
    out = _deep_copy(raw)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise ConfigError(f"override {item!r}: {where} is a {type(child).__name__}, not a section")
            node = child
        node[path[-1]] = value
    return out


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}
