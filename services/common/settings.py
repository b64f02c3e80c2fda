"""Command-line flags and `MMLANE_*` environment variables derived from a config Struct.

A config Struct (each role's config.py, e.g. services/frontend/config.py) is the one definition
of each setting: its name, type, default, docstring and validation. `Settings(Config)` turns
every field into a flag:

- the name is the field's, `_` as `-` and a trailing `_s` (seconds) dropped:
  `drain_timeout_s` is `--drain-timeout`, its environment variable `MMLANE_DRAIN_TIMEOUT`;
- the type is the annotation's: int, float and str take a value, a bool is a switch
  (`--x`, or `--x/--no-x` when it defaults to true), a Literal gives the choices, a list takes
  comma-separated values and may be repeated (`Annotated[list[str], WHOLE]`: each value is one
  item, commas and all, and its environment variable holds one item per line);
- the help is the field's docstring, with the default and the environment variable;
- a nested Struct's fields are flattened, named after the leaf field (`ops.drain_timeout_s` is
  `--drain-timeout`); where several leaves share a name, one flag sets them all.

A flag not given falls back to its environment variable (empty counts as unset), then to the
Struct's default, so validation and its messages stay the Struct's (`load_config`).
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mmlane.protocol.errors import FatalError

PRECEDENCE = ("Each setting is taken from its flag, else from its MMLANE_* environment variable "
              "(shown with the setting; empty counts as unset), else from its default.")


WHOLE = "whole values"
"""Marks a list setting whose items may hold commas (JSON, say): `Annotated[list[str], WHOLE]`."""


@dataclass
class Setting:
    """One flag, and the config fields (dotted paths) it sets."""

    flag: str
    owner: type
    """The Struct that defines it (its `--help` group)."""
    paths: list[str]
    annotation: Any
    default: Any
    doc: str
    env: str | None

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    def parse(self, text: str) -> Any:
        """The value of its environment variable, read as the flag reads its own."""
        kind = _kind(self.annotation)
        if kind is bool:
            return text.strip().lower() in ("1", "true", "yes", "on")
        try:
            if kind is list:
                return _split(text, _item_type(self.annotation), _separator(self.annotation))
            return _scalar_type(self.annotation)(text)
        except ValueError as exc:
            raise FatalError(f"${self.env}: {exc}", code="bad_config") from None


@dataclass
class Settings:
    """The flags of `config_type`. `exclude` names fields (leaf names or dotted paths) that get
    no flag; `no_env` names flags that read no environment variable (`env=False`: none does);
    `renames` maps a field name to the flag it keeps where the two differ."""

    config_type: type[msgspec.Struct]
    exclude: Sequence[str] = ()
    env: bool = True
    no_env: Sequence[str] = ()
    renames: dict[str, str] = field(default_factory=dict)

    @functools.cached_property
    def settings(self) -> list[Setting]:
        by_flag: dict[str, Setting] = {}
        for owner, path, info, doc in _leaves(self.config_type):
            name = path.rpartition(".")[2]
            if name in self.exclude or path in self.exclude:
                continue
            flag = flag_name(self.renames.get(name, name))
            if flag in by_flag:
                by_flag[flag].paths.append(path)
                continue
            env = None if flag in self.no_env or not self.env else env_name(flag)
            by_flag[flag] = Setting(flag, owner, [path], info.type, _default(info), doc, env)
        return list(by_flag.values())

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add every flag, in one `--help` group per Struct that defines some."""
        groups: dict[type, Any] = {}
        for setting in self.settings:
            if setting.owner not in groups:
                doc = (setting.owner.__doc__ or "").strip()
                groups[setting.owner] = parser.add_argument_group(
                    _group_title(setting.owner), " ".join(doc.split()) or None
                )
            groups[setting.owner].add_argument(
                f"--{setting.flag}", dest=setting.dest, default=None, help=_help(setting),
                **_argparse_kind(setting),
            )
        if self.env:
            parser.epilog = PRECEDENCE

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """The settings given (flag, else environment), nested as the config's fields are;
        those given by neither are left out, so they take the Struct's defaults."""
        values: dict[str, Any] = {}
        for setting in self.settings:
            value = getattr(args, setting.dest, None)
            if value is None and setting.env and os.environ.get(setting.env):
                value = setting.parse(os.environ[setting.env])  # raises FatalError
            if value is not None:
                for path in setting.paths:
                    _put(values, path, value)
        return values

    def parse(self, argv: Sequence[str]) -> dict[str, Any]:
        """`values` of a command line holding only these flags (a bench's `serve_args`)."""
        parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        self.add_to(parser)
        try:
            args, unknown = parser.parse_known_args(list(argv))
        except argparse.ArgumentError as exc:
            raise FatalError(str(exc), code="bad_config") from None
        if unknown:
            raise FatalError(f"unknown flags {' '.join(unknown)}", code="bad_config")
        return self.values(args)


def env_name(flag: str) -> str:
    """`drain-timeout` -> `MMLANE_DRAIN_TIMEOUT`."""
    return "MMLANE_" + flag.replace("-", "_").upper()


def flag_name(field_name: str) -> str:
    """`drain_timeout_s` -> `drain-timeout`: dashes, and no seconds suffix."""
    return field_name.removesuffix("_s").replace("_", "-")


def _leaves(
    config_type: type[msgspec.Struct], prefix: str = ""
) -> Iterator[tuple[type, str, msgspec.structs.FieldInfo, str]]:
    """(defining Struct, dotted path, field, docstring) of every non-Struct field, nested
    Structs flattened."""
    docs = field_docs(config_type)
    for info in msgspec.structs.fields(config_type):
        if isinstance(info.type, type) and issubclass(info.type, msgspec.Struct):
            yield from _leaves(info.type, f"{prefix}{info.name}.")
        else:
            yield config_type, f"{prefix}{info.name}", info, docs.get(info.name, "")


@functools.cache
def field_docs(config_type: type) -> dict[str, str]:
    """Each field's docstring: the string literal right below it in the class body (msgspec
    keeps none, and the docstrings are where this tree documents its settings)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(config_type))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _group_title(config_type: type) -> str:
    """`MMWorkerConfig` -> 'mm worker settings'."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z]*", config_type.__name__.removesuffix("Config"))
    return " ".join(words).lower().replace("mm", "MM") + " settings"


def _default(info: msgspec.structs.FieldInfo) -> Any:
    if info.default_factory is not msgspec.NODEFAULT:
        return info.default_factory()
    return None if info.default is msgspec.NODEFAULT else info.default


def _help(setting: Setting) -> str:
    default = setting.default
    if isinstance(default, list):
        default = ",".join(map(str, default)) or "none"
    shown = f"default: {default!r}" if default == "" else f"default: {default}"
    shown += f"; ${setting.env}" if setting.env else ""
    return f"{setting.doc} ({shown})".replace("%", "%%").lstrip()


def _argparse_kind(setting: Setting) -> dict[str, Any]:
    kind = _kind(setting.annotation)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction if setting.default else "store_true"}
    if kind is list:
        item, whole = _item_type(setting.annotation), _whole(setting.annotation)
        return {"action": _ListAction, "metavar": "VALUE" if whole else "LIST",
                "type": lambda text: _split(text, item, None if whole else ",")}
    literal = _literal(setting.annotation)
    if literal:
        return {"choices": literal}
    scalar = _scalar_type(setting.annotation)
    return {"type": scalar, "metavar": scalar.__name__.upper()}


class _ListAction(argparse.Action):
    """Comma-separated values; a repeated flag adds to the list it started."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *values])


def _split(text: str, item: Callable[[str], Any], separator: str | None) -> list[Any]:
    """The items of one value; `separator` None: the value is one item."""
    parts = text.split(separator) if separator else [text]
    return [item(part.strip()) for part in parts if part.strip()]


def _separator(annotation: Any) -> str:
    """What separates a list setting's items in its environment variable: a comma, or for a
    WHOLE list a line break."""
    return "\n" if _whole(annotation) else ","


def _whole(annotation: Any) -> bool:
    return WHOLE in getattr(_non_none(annotation), "__metadata__", ())


def _non_none(annotation: Any) -> Any:
    """`T` of `T | None` (an Annotated `T` stays Annotated)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation


def _kind(annotation: Any) -> Any:
    annotation = _bare(annotation)
    return typing.get_origin(annotation) or annotation


def _bare(annotation: Any) -> Any:
    """`T` of `T | None` and of `Annotated[T, ...]`."""
    annotation = _non_none(annotation)
    return getattr(annotation, "__origin__", annotation) if hasattr(
        annotation, "__metadata__") else annotation


def _literal(annotation: Any) -> list[Any]:
    annotation = _non_none(annotation)
    return list(typing.get_args(annotation)) if _kind(annotation) is typing.Literal else []


def _item_type(annotation: Any) -> Callable[[str], Any]:
    (item,) = typing.get_args(_bare(annotation))
    return _scalar_type(item)


def _scalar_type(annotation: Any) -> Callable[[str], Any]:
    literal = _literal(annotation)
    return type(literal[0]) if literal else _non_none(annotation)


def _put(values: dict[str, Any], path: str, value: Any) -> None:
    *parents, name = path.split(".")
    for parent in parents:
        values = values.setdefault(parent, {})
    values[name] = value
