"""Typed construction of the config dataclasses from plain data (YAML, `--set`, stored runs).

`build_dataclass(cls, raw, prefix)` checks every key and value against the dataclass's fields and
annotations; an unknown key (with the nearest allowed one), a value of the wrong type or an integer
past 64 bits raises `ConfigError` naming the dotted key. `plain` is the inverse, for `to_dict`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from tessera.config.errors import ConfigError
from tessera.config.limits import MAX_INT


def build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a dict, checking keys and types; errors name `prefix + key`."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a section (a mapping), got {type(raw).__name__} {raw!r}")
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
            raise ConfigError(f"unknown key {prefix}{key}{hint}; allowed in {where}: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {fields[key].name: _coerce(value, hints[fields[key].name], f"{prefix}{key}")
              for key, value in raw.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} is invalid: {e}") from e


class _WrongType(ConfigError):
    """A value whose type does not match its field (the next member of a union may still fit)."""


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}.get(
            tp.__name__, tp.__name__)
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` checked against the annotation `tp`; ints widen to float, lists become tuples."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), key)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value if value is not None else {}, key + ".")
    if origin in (list, tuple):
        return _coerce_sequence(value, origin, typing.get_args(tp), key)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _WrongType(f"{key}={value!r} has the wrong type: expected a mapping")
        return value
    return _coerce_scalar(value, tp, key)


def _coerce_union(value: Any, args: tuple, key: str) -> Any:
    """The first member of `X | Y | None` that `value` fits; a mapping builds the union's section."""
    if value is None and type(None) in args:
        return None
    sections = [a for a in args if dataclasses.is_dataclass(a)]
    if isinstance(value, dict) and sections:  # a section: its own errors name the inner key
        return build_dataclass(sections[0], value, key + ".")
    for arg in (a for a in args if a is not type(None)):
        try:
            return _coerce(value, arg, key)
        except _WrongType:  # try the next type; a value of the right type but out of range is final
            continue
    expected = " or ".join(map(_type_name, args))
    raise _WrongType(f"{key}={value!r} has the wrong type: expected {expected}")


def _coerce_sequence(value: Any, origin: type, args: tuple, key: str) -> list | tuple:
    """A `list[X]` (each element checked), or a `tuple[X, Y]` / `tuple[X, ...]` from a list."""
    if origin is list:
        if not isinstance(value, list):
            raise _WrongType(f"{key}={value!r} has the wrong type: expected a list")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    fixed = bool(args) and args[-1] is not Ellipsis
    if not isinstance(value, (list, tuple)) or (fixed and len(value) != len(args)):
        expected = f"a list of {len(args)} values" if fixed else "a list"
        raise _WrongType(f"{key}={value!r} has the wrong type: expected {expected}")
    elem = [args[0]] * len(value) if args and args[-1] is Ellipsis else list(args)
    return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, elem)))


def _coerce_scalar(value: Any, tp: Any, key: str) -> Any:
    """A boolean, a 64-bit integer, a finite number (from an int, or a string YAML left unread), a
    string (from a number YAML read as one), or an instance of another class."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:
                raise ConfigError(f"{key}={value!r} is invalid: integers must fit 64 bits (|value| <= {MAX_INT})")
            return value
    elif tp is float:
        number = _number(value)
        if number is not None:
            if not math.isfinite(number):  # .inf and .nan pass every `> 0` check below them
                raise ConfigError(f"{key}={value!r} is invalid: must be a finite number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # YAML read `run_dir=2024` as a number
            return str(value)
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _WrongType(f"{key}={value!r} has the wrong type: expected {_type_name(tp)}")


def _number(value: Any) -> float | None:
    """`value` as a float (an int past 1e308 as inf), None when it is not a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if abs(value) <= 1e308 else math.inf
    if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            return None
    return None


def config_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and `--set`: its name, or metadata["key"] for a keyword (checkpoint.async)."""
    return f.metadata.get("key", f.name)


def plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f): plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj
