"""YAML mappings -> typed dataclasses, with errors that name the file, the field path and the expectation.

``build_dataclass`` checks a mapping against a dataclass's type hints (unknown
keys, missing fields, wrong types, enum names, non-finite numbers) and builds
it; a ``FieldError`` (or other ``ValueError``/``TypeError``) raised by the
dataclass's own ``__post_init__`` becomes a ``ConfigError`` at that field's path.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from tiercache.common.fields import FieldError

CONVERSION_ERRORS = (ValueError, TypeError, OverflowError, ArithmeticError)
"""What a dataclass's or a policy's own validation raises for a bad value."""


class ConfigError(ValueError):
    """A configuration problem: where (file, field) and what was expected."""

    def __init__(self, source: str, field_path: str, expected: str, got: Any = dataclasses.MISSING):
        self.source = source
        self.field_path = field_path
        self.expected = expected
        got_text = "" if got is dataclasses.MISSING else f", got {got!r}"
        super().__init__(f"{source}: {field_path or '<top level>'}: expected {expected}{got_text}")


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(tp: Any, value: Any, source: str, path: str) -> Any:
    """Check ``value`` against the type hint ``tp`` and convert (enums, dataclasses)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        shaped = _dataclass_of_shape(typing.get_args(tp), value)
        if shaped is not None:  # a mapping whose keys say which dataclass it is: that one's errors are precise
            return build_dataclass(shaped, value, source, path)
        for option in typing.get_args(tp):
            try:
                return _convert(option, value, source, path)
            except ConfigError:
                continue
        raise ConfigError(source, path, _type_name(tp), value)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(source, path, "null", value)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, source, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(source, path, _type_name(tp), value) from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(source, path, "a list", value)
        (item_type,) = typing.get_args(tp) or (Any,)
        return [_convert(item_type, item, source, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(source, path, "a mapping", value)
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(source, path, "true or false", value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(source, path, "an integer", value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise ConfigError(source, path, "a finite number", value) from None
            if math.isfinite(number):
                return number
        raise ConfigError(source, path, "a finite number", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(source, path, "a string", value)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(source, path, _type_name(tp), value)


def _dataclass_of_shape(options: tuple[Any, ...], value: Any) -> type | None:
    """The first dataclass among ``options`` whose fields take every key of the mapping ``value`` (None: not a
    mapping, or no such dataclass)."""
    if not isinstance(value, Mapping):
        return None
    for option in options:
        if dataclasses.is_dataclass(option) and set(value) <= {f.name for f in dataclasses.fields(option) if f.init}:
            return option  # type: ignore[return-value]
    return None


def build_dataclass(cls: type, data: Any, source: str, path: str) -> Any:
    """Build dataclass ``cls`` from a mapping: unknown keys, missing fields and wrong types are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, path, "a mapping", data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    for key in data:
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                source, f"{prefix}{key}", f"one of the known fields ({allowed}){hint}", "unknown field"
            )
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], source, f"{prefix}{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(source, f"{prefix}{name}", f"a value ({_type_name(hints[name])}); it is required")
    try:
        return cls(**kwargs)
    except FieldError as error:
        got = error.got if error.has_value else dataclasses.MISSING
        raise ConfigError(source, f"{prefix}{error.field}", error.expected, got) from None
    except CONVERSION_ERRORS as error:
        raise ConfigError(source, path, f"valid options ({error})") from None
