"""Command-line flags from a config dataclass: each option defined once, as a typed field with a one-line docstring.

A command's flags are its config's fields: ``batch_size`` is ``--batch-size`` (or the names ``flag(...)`` gives
it), of the field's type, with the field's default, and the field's docstring as its help. A field that is itself a
config adds its own fields as a group of flags; one marked ``NO_FLAG`` is set from Python only. :func:`build` makes
the config from what argparse parsed, so ``__post_init__`` checks every value where it is defined, and
:func:`to_argv` writes a config back as flags (the demo hands its job's options to every process that way).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")
_KEY = "paratrain.flag"
_PLAIN = (int, float, str)


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a field shows on the command line."""

    names: tuple[str, ...] = ()
    """Its option strings; default ``--field-name``."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    negative: str | None = None
    """For a ``bool | None`` field: the flag that sets it False (``--untied``); the first name sets it True."""
    title: str | None = None
    """For a config field: the title of its group of flags (default: the field's name)."""
    shown: bool = True
    """False: no flag (set from Python only)."""


def flag(
    *names: str,
    metavar: str | None = None,
    choices: Iterable[str] | None = None,
    negative: str | None = None,
    title: str | None = None,
) -> Mapping[str, Flag]:
    """A field's ``metadata=``: its option strings and how they read."""
    return types.MappingProxyType(
        {_KEY: Flag(names, metavar, None if choices is None else tuple(choices), negative, title)}
    )


NO_FLAG = types.MappingProxyType({_KEY: Flag(shown=False)})
"""A field's ``metadata=`` when it is set from Python only."""


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    defaults: object = None,
) -> None:
    """One flag per field of ``cls`` (``only`` those, less ``skip``), defaults from ``defaults`` when given, else
    the fields'; a config field's fields in a group of its own, with that field's default as theirs."""
    wanted, skipped = None if only is None else set(only), set(skip)
    for f, hint in _fields(cls):
        if (wanted is not None and f.name not in wanted) or f.name in skipped:
            continue
        default = _default(f) if defaults is None else getattr(defaults, f.name)
        if _is_config(hint):
            group = parser.add_argument_group(_spec(f).title or f.name.replace("_", " "))
            add_flags(group, _config_type(hint), defaults=default)  # type: ignore[arg-type]
        else:
            _add(parser, f, hint, cls, default)


def build(cls: type[T], namespace: argparse.Namespace, **given: Any) -> T:
    """``cls`` from the flags argparse parsed (its other fields from ``given``, else their defaults)."""
    values: dict[str, Any] = {}
    for f, hint in _fields(cls):
        if _is_config(hint):
            values[f.name] = build(_config_type(hint), namespace)
        elif hasattr(namespace, f.name):
            values[f.name] = getattr(namespace, f.name)
    return cls(**{**values, **given})


def to_argv(config: object, *, only: Iterable[str] | None = None, skip: Iterable[str] = ()) -> list[str]:
    """The flags that give ``config``'s values (``only`` those fields, less ``skip``), leaving defaults out."""
    wanted, skipped = None if only is None else set(only), set(skip)
    out: list[str] = []
    for f, hint in _fields(type(config)):
        value = getattr(config, f.name)
        if (wanted is not None and f.name not in wanted) or f.name in skipped or value == _default(f):
            continue
        if _is_config(hint):
            raise TypeError(f"to_argv writes flat configs; skip {f.name!r} or write it apart")
        spec = _spec(f)
        name = _names(f, spec)[0]
        if value is True:
            out.append(name)
        elif value is False:
            out.append(spec.negative or f"--no-{name.removeprefix('--')}")
        else:
            out += [name, str(value)]
    return out


def flag_name(cls: type, name: str) -> str:
    """The option users write for field ``name`` of ``cls`` (``--batch`` for ``micro_batch``)."""
    f = next(f for f, _ in _fields(cls) if f.name == name)
    return next(n for n in _names(f, _spec(f)) if n.startswith("--"))


def at_least(config: object, bounds: Mapping[str, float]) -> None:
    """A one-line ``ConfigError`` naming the flag of the first field below its bound (None is left alone)."""
    for name, low in bounds.items():
        value = getattr(config, name)
        if value is not None and value < low:
            raise ConfigError(f"{flag_name(type(config), name)} must be >= {low:g}, got {value:g}")


def positive(config: object, names: Iterable[str]) -> None:
    """A one-line ``ConfigError`` naming the flag of the first field that is not > 0 (None is left alone)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{flag_name(type(config), name)} must be > 0, got {value:g}")


def _add(parser: Any, f: dataclasses.Field, hint: Any, cls: type, default: Any) -> None:
    spec = _spec(f)
    names, kind = _names(f, spec), _plain(hint)
    help_text = _help(cls).get(f.name, "").replace("%", "%%")
    common: dict[str, Any] = {"dest": f.name, "help": help_text}
    if default is dataclasses.MISSING:
        common["required"] = True
    else:
        common["default"] = default
    if kind is bool:
        if default is None:
            parser.add_argument(*names, action="store_const", const=True, **common)
            if spec.negative:
                parser.add_argument(
                    spec.negative, action="store_const", const=False, dest=f.name, help=f"the opposite of {names[0]}"
                )
        elif default is True:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        else:
            parser.add_argument(*names, action="store_true", **common)
        return
    if default not in (None, dataclasses.MISSING):
        common["help"] = f"{help_text.rstrip('.')} (default: {default})".lstrip()
    long = next((n for n in names if n.startswith("--")), names[0])
    metavar = spec.metavar or (None if spec.choices else long.lstrip("-").upper().replace("-", "_"))
    parser.add_argument(*names, type=kind, metavar=metavar, choices=spec.choices, **common)


def _fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """The fields of ``cls`` that are flags, with their types."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init and _spec(f).shown:
            yield f, hints[f.name]


def _spec(f: dataclasses.Field) -> Flag:
    return f.metadata.get(_KEY, Flag())


def _names(f: dataclasses.Field, spec: Flag) -> tuple[str, ...]:
    return spec.names or (f"--{f.name.replace('_', '-')}",)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _options(hint: Any) -> tuple[Any, ...]:
    """``X | None`` -> (X,); anything else -> (hint,)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(a for a in typing.get_args(hint) if a is not type(None))
    return (hint,)


def _plain(hint: Any) -> type:
    options = _options(hint)
    if len(options) != 1 or options[0] not in (*_PLAIN, bool):
        raise TypeError(f"a flag needs a field of type int, float, str or bool (or one of them | None), not {hint}")
    return options[0]


def _is_config(hint: Any) -> bool:
    options = _options(hint)
    return len(options) == 1 and dataclasses.is_dataclass(options[0])


def _config_type(hint: Any) -> type:
    return _options(hint)[0]


@functools.cache
def _help(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), its first paragraph on one line."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        except (OSError, TypeError):  # no source (a frozen build): flags without help
            continue
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                text = inspect.cleandoc(after.value.value).split("\n\n")[0]
                out[node.target.id] = re.sub(r"\s+", " ", text.replace("``", "")).strip()
    return out
