"""YAML for configurations, read strictly: safe tags only, no duplicate keys, bounded size.

`yaml.safe_load` already refuses Python objects, but it silently keeps the last of two equal keys
(`lr` written twice: which one trains?), and its aliases are references that later copies
expand: nine aliases of nine aliases (the "billion laughs" document) is a few hundred bytes that
expands to 10^9 values, and `&a [*a]` is a list that contains itself. `load_yaml` refuses all of
these with a `ConfigError` naming the source, before any value is built:

- a key written twice in one mapping (merge keys `<<: *base` may still be overridden);
- more than `MAX_YAML_NODES` values once every alias is expanded, or nesting deeper than
  `MAX_YAML_DEPTH`, or an alias inside its own anchor.

`read_config_file` also refuses a file that is not UTF-8 or is larger than `MAX_CONFIG_BYTES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from tessera.config.errors import ConfigError
from tessera.config.json_text import check_json_text
from tessera.config.limits import MAX_CONFIG_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, second_line: int):
        super().__init__(f"key {key!r} appears twice in one section (lines {first_line} and {second_line}); "
                         "keep one")


class _TooDeep(Exception):
    def __init__(self, line: int):
        super().__init__(f"nested too deeply (at most {MAX_YAML_DEPTH} levels, line {line})")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse a key they already hold and whose nesting is bounded
    while it is read (the composer recurses once per level)."""

    _depth = 0

    def fetch_flow_collection_start(self, TokenClass: type) -> None:  # noqa: N803 - PyYAML's name
        # The scanner looks ahead over every open `[`/`{` of a flow collection for each token:
        # refuse deep flow nesting before that lookahead turns quadratic.
        if self.flow_level >= MAX_YAML_DEPTH:
            raise _TooDeep(self.get_mark().line + 1)
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str) -> Any:
    """The YAML document in `text` as plain data; `source` names it in errors (a file, an override)."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, set(), 1, source)
        return check_json_text(loader.construct_document(node), source, ConfigError)
    except (_DuplicateKey, _TooDeep) as e:
        raise ConfigError(f"{source}: {e}") from None
    finally:
        loader.dispose()


def read_config_file(path: Path) -> Any:
    """The YAML document of a config file, read strictly (`load_yaml`): a missing, unreadable,
    oversized (past `MAX_CONFIG_BYTES`), non-UTF-8 or malformed file is a `ConfigError` naming it."""
    where = f"config file {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where} does not exist")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{where} is {size:,} bytes; a config file may hold at most {MAX_CONFIG_BYTES:,}")
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (byte {e.start} is {data[e.start:e.start + 1]!r}); "
                          "save it as UTF-8") from None
    try:
        return load_yaml(text, where)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from e


def _expanded_size(node: Node, sizes: dict[int, int], open_nodes: set[int], depth: int, source: str) -> int:
    """Values under `node` counting every alias in full; refuses cycles, depth and size past the bounds."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ConfigError(f"{source}: an alias refers to a section that contains it (line "
                          f"{node.start_mark.line + 1}); a configuration must be a tree")
    if depth > MAX_YAML_DEPTH:
        raise ConfigError(f"{source}: nested too deeply (at most {MAX_YAML_DEPTH} levels, line "
                          f"{node.start_mark.line + 1})")
    if isinstance(node, SequenceNode):
        children = list(node.value)
    elif isinstance(node, MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = []
    open_nodes.add(key)
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_nodes, depth + 1, source)
        if total > MAX_YAML_NODES:
            raise ConfigError(f"{source}: expands to more than {MAX_YAML_NODES:,} values once its aliases "
                              "are expanded (refused: a configuration is never that large)")
    open_nodes.discard(key)
    sizes[key] = total
    return total
