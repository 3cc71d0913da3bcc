"""Reading a YAML file into typed, frozen dataclasses, the way every kvwatch config is read: defaults first,
then each given key converted to its field's type; an unknown key, a wrong type or a YAML slip is one
`ConfigError` naming the file and the key's full path. The sections themselves are in settings.py."""

from __future__ import annotations

import math
import os
import types
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from kvwatch.core.errors import KVWatchError
from kvwatch.core.registry import did_you_mean
from kvwatch.core.strict_yaml import StrictLoader, plain_problem

T = TypeVar("T")
# What a config file may be: a real one is a few kilobytes and five levels deep; far more is a mistake that
# would otherwise be read whole into memory (and one nested deeper, StrictLoader refuses).
MAX_CONFIG_BYTES = 1 << 20
# Keys someone might paste a secret under; the message says how to do it instead.
_SECRET_KEYS = {"api_key", "apikey", "key", "token", "api_token", "password"}
# Where a section takes its secret from, for that message: each section that has one registers it here
# (settings.py); a target's is the default.
SECRET_SOURCES: dict[type, tuple[str, str]] = {}


class ConfigError(KVWatchError):
    """The config cannot be used; the message says the one thing that is wrong and where."""


class Invalid(KVWatchError, ValueError):
    """A failed check at `where`, relative to the object being checked ("" for the object itself)."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where
        self.message = message


def check(ok: object, where: str, message: str) -> None:
    if not ok:
        raise Invalid(where, message)


def load_yaml(cls: type[T], path: str | os.PathLike) -> T:
    """Read a YAML file as the dataclass `cls`, checked as a config is (unknown keys, types, ranges, YAML
    errors); any problem is one `ConfigError` naming the file."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # no more: the path may be a huge file or /dev/zero
        check(len(data) <= MAX_CONFIG_BYTES, "", "larger than 1 MiB; a kvwatch config is a few kilobytes")
        return _parse(data.decode("utf-8"), cls)
    except OSError as error:
        problem = f"cannot read it: {error.strerror}"
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    except Invalid as error:
        problem = str(error)
    raise ConfigError(f"error in {path}: {problem}")


def _parse(text: str, cls: type[T]) -> T:
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        raise Invalid(
            "", f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {plain_problem(error)}"
        ) from None
    except yaml.YAMLError as error:  # e.g. a control character, which has a position but no line
        raise Invalid("", f"invalid YAML: {str(error).splitlines()[0]}") from None
    check(data is not None, "", "the file is empty")
    check(isinstance(data, dict), "", f"the top level must be a mapping of keys, got {describe(data)}")
    return _build(cls, data, "")


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _build(cls: type, data: object, path: str):
    """Make `cls` from a YAML mapping: its defaults first, then every given key converted to its type."""
    check(isinstance(data, dict), path, f"expected a mapping, got {describe(data)}")
    known = {field.name: field for field in fields(cls)}
    for key in data:
        if key in known:
            continue
        if key in _SECRET_KEYS:
            env, file = SECRET_SOURCES.get(cls, ("api_key_env", "api_key_file"))
            raise Invalid(
                _join(path, key),
                f"secrets do not belong in the config file; name an environment variable ({env}) "
                f"or a file ({file}) that holds it",
            )
        raise Invalid(
            _join(path, key), f"unknown key;{did_you_mean(key, known)} known: {', '.join(sorted(known))}"
        )
    hints = get_type_hints(cls)
    values = {}
    for name, field in known.items():
        if name in data:
            where, read = _join(path, name), field.metadata.get("read")  # "read": a key's own reader
            values[name] = read(data[name], where) if read else _convert(hints[name], data[name], where)
        else:
            check(field.default is not MISSING, _join(path, name), "required key is missing")
    try:
        return cls(**values)
    except ValueError as error:  # Invalid, or a section's own check (a target kind's EndpointProblem)
        where, message = getattr(error, "where", ""), getattr(error, "message", str(error))
        raise Invalid(_join(path, where) if where else path, message) from None


def _convert(kind: Any, value: object, path: str):
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):  # `X | None`: null is None
        if value is None:
            return None
        (kind,) = (arg for arg in get_args(kind) if arg is not type(None))
        return _convert(kind, value, path)
    if origin is Literal:
        allowed = get_args(kind)
        hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
        check(
            value in allowed,
            path,
            f"must be one of {', '.join(allowed)}; got {describe(value)}{hint and ';'}{hint}",
        )
        return value
    if origin is tuple:  # tuple[X, ...], from a YAML list
        check(isinstance(value, list), path, f"expected a list, got {describe(value)}")
        item_kind = get_args(kind)[0]
        return tuple(_convert(item_kind, item, f"{path}[{i}]") for i, item in enumerate(value))
    if is_dataclass(kind):
        return _build(kind, value, path)
    if kind is bool:
        check(isinstance(value, bool), path, f"expected true or false, got {describe(value)}")
        return value
    if kind in (int, float):
        # YAML's true/false are ints to Python; an int is a fine float, a float is not an int.
        ok = isinstance(value, int if kind is int else int | float) and not isinstance(value, bool)
        check(ok, path, f"expected {'an integer' if kind is int else 'a number'}, got {describe(value)}")
        try:
            return kind(value)
        except OverflowError:  # an integer beyond any float: out of every range, as infinity is
            return math.inf if value > 0 else -math.inf
    check(isinstance(value, str), path, f"expected a string, got {describe(value)}")
    check(value, path, "must not be empty")
    return Path(value).expanduser() if kind is Path else value


def describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f'the string "{value}"'
    if isinstance(value, int | float):
        return f"the number {value}"
    return "a mapping" if isinstance(value, dict) else "a list"
