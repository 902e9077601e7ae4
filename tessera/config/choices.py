"""Named choices: a value picked by name from a table, with the one error every table gives.

The planner's tables (precisions, activation dtypes) are looked up by the names the command line
and the Python API pass; an unknown name gets a ConfigError that names the key, the value and
every allowed name, in the project's `key=value is invalid: one of ...` form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from tessera.config.errors import ConfigError

T = TypeVar("T")


def lookup_choice(table: Mapping[str, T], name: str, key: str) -> T:
    """`table[name]`; ConfigError naming `key`, `name` and the table's names when it has none."""
    if name not in table:
        raise ConfigError(f"{key}={name!r} is invalid: one of {', '.join(table)}")
    return table[name]
