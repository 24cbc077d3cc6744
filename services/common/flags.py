"""Command-line flags made from option classes, so that each setting is declared once.

A field `max_num_seqs: int = 256` of an options dataclass (or a msgspec Struct) becomes
`--max-num-seqs` of type int, its default shown in `--help`; a bool becomes `--x/--no-x`, a
`StrEnum` lists its values as choices, a `tuple[T, ...]` is a repeatable flag. A dataclass field's
`metadata` may carry `help`, `choices` (for a str field with a fixed set of values) and
`default_text` (how `--help` shows the default). `to_argv` turns values back into flags: that is
how `parkade up` hands each service its settings, so a new option reaches the services without
anyone listing it again.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag for the option field `name`."""

    name: str
    kind: type  # int, float, str, bool, Path or a StrEnum; the element type of a repeated flag
    default: Any
    help: str = ""
    choices: tuple[str, ...] | None = None
    repeated: bool = False
    default_text: str | None = None

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, value: Any) -> Any:
        """The option value of what argparse produced."""
        if self.repeated:  # NOTE: argparse's default for "append" is None, never the flag's own
            return tuple(value) if value is not None else tuple(self.default or ())
        if value is None:
            return None
        if issubclass(self.kind, enum.Enum | Path):
            return self.kind(value)
        return value


def _kind(annotation: Any) -> tuple[type, bool]:
    """(scalar type, repeated) of a field annotation; None in a union is dropped, and a union of
    several types is read as str (e.g. `str | torch.dtype` on the command line)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _kind(members[0])
        return (Path if Path in members else str), False
    if origin is tuple:
        return typing.get_args(annotation)[0], True
    return annotation, False


def field_default(field: dataclasses.Field) -> Any:
    """A dataclass field's default; a default_factory is called now (e.g. one that reads an
    environment variable: the flag's default, as `--help` shows it, is what applies)."""
    factory = field.default_factory
    return factory() if factory is not dataclasses.MISSING else field.default


def dataclass_flags(cls: type, exclude: Iterable[str] = ()) -> list[Flag]:
    """A flag for every init field of the dataclass `cls` but those in `exclude`."""
    hints = typing.get_type_hints(cls)
    flags = []
    for field in dataclasses.fields(cls):
        if not field.init or field.name in exclude:
            continue
        kind, repeated = _kind(hints[field.name])
        meta = field.metadata
        default = field_default(field)
        flags.append(
            Flag(
                name=field.name,
                kind=kind,
                default=default,
                help=meta.get("help", ""),
                choices=meta.get("choices"),
                repeated=repeated,
                default_text=meta.get("default_text"),
            )
        )
    return flags


def struct_flags(cls: type, help: Mapping[str, str], exclude: Iterable[str] = ()) -> list[Flag]:
    """A flag for every field of the msgspec Struct `cls` but those in `exclude`."""
    flags = []
    for field in msgspec.structs.fields(cls):
        if field.name in exclude:
            continue
        kind, repeated = _kind(field.type)
        flags.append(Flag(field.name, kind, field.default, help.get(field.name, ""), repeated=repeated))
    return flags


def add_flags(parser: argparse.ArgumentParser | Any, flags: Sequence[Flag]) -> None:
    """Add `flags` to a parser (or an argument group). Defaults appear in `--help`."""
    for flag in flags:
        help_text = flag.help
        shown = flag.default_text or _shown(flag.default)
        if shown is not None:
            help_text = f"{help_text} (default: {shown})" if help_text else f"default: {shown}"
        help_text = help_text.replace("%", "%%")
        if flag.kind is bool and not flag.repeated:
            parser.add_argument(
                flag.option, action=argparse.BooleanOptionalAction, default=flag.default, help=help_text
            )
            continue
        choices = flag.choices
        kind: Any = flag.kind
        if isinstance(flag.kind, type) and issubclass(flag.kind, enum.Enum):
            choices, kind = tuple(e.value for e in flag.kind), str
        parser.add_argument(
            flag.option,
            type=str if kind is Path else kind,  # parse() makes the Path
            default=None if flag.repeated else flag.default,
            action="append" if flag.repeated else "store",
            choices=choices,
            help=help_text,
            metavar=_metavar(flag, choices),
        )


def _metavar(flag: Flag, choices: tuple[str, ...] | None) -> str:
    if choices:
        return "{" + ",".join(choices) + "}"
    return flag.name.upper() if flag.kind is not Path else "DIR"


def _shown(default: Any) -> str | None:
    """How `--help` shows a default; None: not at all (None and empty defaults explain
    themselves in the help text)."""
    if default is None or default == () or default is dataclasses.MISSING:
        return None
    if isinstance(default, tuple):
        return " ".join(_text(item) for item in default)
    return _text(default)


def flag_values(flags: Sequence[Flag], args: argparse.Namespace) -> dict[str, Any]:
    """{field name: value} of parsed arguments, ready for the options class."""
    return {flag.name: flag.parse(getattr(args, flag.name)) for flag in flags}


def to_argv(flags: Sequence[Flag], values: Mapping[str, Any]) -> list[str]:
    """The command-line flags that give `values` (each one that differs from its default).

    Raises ValueError for a value no flag can express: None where the default is not None, an
    empty tuple where the default is not empty."""
    argv: list[str] = []
    for flag in flags:
        if flag.name not in values:
            continue
        value = values[flag.name]
        if value == flag.default or (flag.repeated and tuple(value) == tuple(flag.default or ())):
            continue
        if value is None:
            raise ValueError(f"{flag.option} cannot be set to None on the command line")
        if flag.repeated and not value:
            raise ValueError(
                f"{flag.option} cannot be emptied on the command line (its default is not empty)"
            )
        if flag.kind is bool and not flag.repeated:
            argv.append(flag.option if value else "--no-" + flag.option[2:])
        elif flag.repeated:
            for item in value:
                argv += [flag.option, _text(item)]
        else:
            argv += [flag.option, _text(value)]
    return argv


def _text(value: Any) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)
