"""Turns plain YAML data into frozen config dataclasses, with one clear message per mistake.

This is the only place that reads raw dicts: every section class is a frozen dataclass whose
field types drive the conversion here (int, float, str, bool, Literal, Optional, Mapping and
nested dataclasses). Messages name the dotted field path, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from oobleck_elastic.errors import ConfigError

__all__ = ["parse_section", "did_you_mean", "join_path"]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def join_path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def did_you_mean(key: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_section(cls: type[T], data: Any, path: str = "") -> T:
    """Builds dataclass `cls` from mapping `data`; `path` prefixes field names in messages."""
    where = path or "the configuration"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    # A class may collect its unknown keys into one mapping field (an optimizer's keyword
    # arguments, say), so users write `optimizer: {name: AdamW, lr: 0.001}`.
    rest_field = getattr(cls, "__config_rest__", None)
    if rest_field is not None:
        rest = {k: v for k, v in data.items() if k not in fields}
        data = {k: v for k, v in data.items() if k in fields}
        data[rest_field] = {**data.get(rest_field, {}), **rest}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"unknown key '{join_path(path, str(key))}'{did_you_mean(str(key), fields)}; "
                f"{where} accepts: {known}"
            )
    hints = get_type_hints(cls)
    kwargs = {name: _convert(hints[name], data[name], join_path(path, name)) for name in data}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if get_origin(tp) is tuple:
        return "a list"
    if get_origin(tp) in (Mapping, dict) or tp in (dict, Mapping):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as exc:
                errors.append(exc)
        accepted = " or ".join(_type_name(o) for o in options if o is not type(None))
        if type(None) in options:
            accepted += " or null"
        raise ConfigError(f"{path} must be {accepted}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path} must be {_type_name(tp)}, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a dataclass type, not an instance
        return parse_section(tp, value, path)
    if origin is tuple:  # tuple[X, ...]: a YAML list of X
        if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        item = get_args(tp)[0]
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return types.MappingProxyType({str(k): v for k, v in value.items()})
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    raise AssertionError(f"config field {path} has an unsupported type {tp!r}")
