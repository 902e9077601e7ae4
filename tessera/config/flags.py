"""Command-line options declared once, on the dataclass field each one sets.

A field's `metadata` holds its option (`flag(...)`): the help, the spelling (`--kv-cache-gib` for
`kv_cache_gib` unless `name` says otherwise), the argparse converter and choices; its default is the
field's own unless the option states why it differs. A field that is a section of several options
(`section(...)`) holds the section's class, whose fields declare their own. From that, `add_flags`
adds the options to an argparse parser and `values_from_args` reads the parsed values back as the
fields' values, so a command never spells an option, its help or its default a second time (the way
vLLM's EngineArgs and torchtitan's generated CLI do). `flag_text` spells a field as its option for
an error message a command-line user reads.

    kv_cache_gib: float = field(default=1.0, metadata=flag("memory for the KV cache", type=positive_float()))
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_UNSET = object()


@dataclass(frozen=True)
class Flag:
    """The command-line option of one field."""

    help: str
    name: str = ""  # the option ("--no-prefix-caching"); "": "--" and the field's name with dashes
    type: Callable[[str], Any] | None = None  # argparse's converter of the text given
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    # "store_true" (a switch), "store_false" (a switch that clears the field: --no-X) or "append"
    # (repeatable); None: one value
    action: str | None = None
    default: Any = _UNSET  # the option's default where it differs from the field's (say why where declared)
    to_field: Callable[[Any], Any] | None = None  # the parsed value -> the field's value (None: as parsed)
    # the attribute argparse stores the value under ("": as argparse names the option; a store_false
    # switch's is the field's own)
    dest: str = ""
    # A switch with an opposite (`--gguf-dequantize` of `--gguf-keep-quantized`): the field is True with
    # the option, False with the opposite, its own default (None: decided where it is read) with
    # neither; the two together are an argparse error (exit 2). "": no opposite.
    opposite: str = ""
    opposite_help: str = ""


@dataclass(frozen=True)
class Section:
    """A field whose value is a dataclass of several options, present when its `key` option is given."""

    cls: type
    key: str  # the section's field whose option turns it on (None when the option is not given: no section)


def flag(help: str, **spelling: Any) -> dict[str, Flag]:
    """The `metadata=` of a field set by one option (`Flag`'s fields as keywords)."""
    return {"flag": Flag(help, **spelling)}


def section(cls: type, key: str) -> dict[str, Section]:
    """The `metadata=` of a field set by the options of dataclass `cls`, present when `key`'s is given."""
    return {"flag": Section(cls, key)}


def _flags(cls: type, names: Iterable[str] | None) -> list[tuple[dataclasses.Field, Flag | Section]]:
    """The fields of `cls` that declare an option, in `names`' order (None: the class's, all of them)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if "flag" in f.metadata}
    chosen = list(fields) if names is None else list(names)
    unknown = [n for n in chosen if n not in fields]
    if unknown:
        raise ValueError(f"{cls.__name__} has no option for {unknown}")
    out = []
    for name in chosen:
        f = fields[name]
        spec = f.metadata["flag"]
        if isinstance(spec, Flag):
            option = spec.name or "--" + f.name.replace("_", "-")
            dest = f.name if spec.action == "store_false" else option.lstrip("-").replace("-", "_")
            spec = dataclasses.replace(spec, name=option, dest=spec.dest or dest)
        out.append((f, spec))
    return out


def _default(f: dataclasses.Field, spec: Flag) -> Any:
    if spec.default is not _UNSET:
        return spec.default
    if spec.action == "store_true" and not spec.opposite:
        return False
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
              names: Iterable[str] | None = None) -> None:
    """Add the options of dataclass `cls`'s fields (those in `names`, in that order; None: all that
    declare one, in the class's order; a section adds its own options in its place)."""
    for f, spec in _flags(cls, names):
        if isinstance(spec, Section):
            add_flags(parser, spec.cls)
            continue
        if spec.opposite:
            _add_switch_pair(parser, spec, _default(f, spec))
            continue
        options = {"type": spec.type, "choices": spec.choices, "metavar": spec.metavar}
        options = {k: v for k, v in options.items() if v is not None}
        if spec.action is not None:
            options["action"] = spec.action
        parser.add_argument(spec.name, dest=spec.dest, default=_default(f, spec), help=spec.help, **options)


def _add_switch_pair(parser: argparse.ArgumentParser | argparse._ArgumentGroup, spec: Flag, default: Any) -> None:
    """A switch and its opposite, one destination, refused together by argparse."""
    pair = parser.add_mutually_exclusive_group()
    pair.add_argument(spec.name, dest=spec.dest, action="store_const", const=True, default=default, help=spec.help)
    pair.add_argument(spec.opposite, dest=spec.dest, action="store_const", const=False, default=default,
                      help=spec.opposite_help)


def values_from_args(cls: type, args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The values the parsed options give the fields of `cls` (`names`: as for `add_flags`), for
    `cls(**values)`: each converted by its `to_field`; a section built when its key option was given."""
    values = {}
    for f, spec in _flags(cls, names):
        if isinstance(spec, Section):
            inner = values_from_args(spec.cls, args)
            values[f.name] = spec.cls(**inner) if inner[spec.key] is not None else None
            continue
        value = getattr(args, spec.dest)
        values[f.name] = spec.to_field(value) if spec.to_field is not None else value
    return values


def flag_text(cls: type, name: str, value: Any) -> str:
    """Field `name` of `cls` set to `value` as a command line gives it (`--tensor-parallel-size 2`,
    `--gguf-keep-quantized`, `--gguf-dequantize` for its opposite; the option alone for a switch or a
    repeatable one), for an error a
    command-line user reads; `name=value` for a field without an option."""
    if "flag" not in next(f for f in dataclasses.fields(cls) if f.name == name).metadata:
        return f"{name}={value!r}"
    [(_, spec)] = _flags(cls, [name])
    if isinstance(spec, Flag) and spec.opposite and value is False:
        return spec.opposite
    if isinstance(spec, Section) or spec.action is not None:
        return spec.name if isinstance(spec, Flag) else name
    return f"{spec.name} {value}"
