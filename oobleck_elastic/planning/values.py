"""JSON round-trip for the planner's frozen dataclasses (plans are values: print, save, reload).

`to_jsonable` turns a dataclass tree into dicts/lists; `from_jsonable` rebuilds it from the
field type hints, so every plan class gets the same exact round trip without hand-written code.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

__all__ = ["to_jsonable", "from_jsonable", "dumps", "loads"]

T = TypeVar("T")


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def from_jsonable(tp: Any, data: Any) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a dataclass type, not an instance
        hints = _hints(tp)
        return tp(**{f.name: from_jsonable(hints[f.name], data[f.name])
                     for f in dataclasses.fields(tp) if f.name in data})
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        options = [a for a in get_args(tp) if a is not type(None)]
        return from_jsonable(options[0], data)
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], v) for v in data)
        return tuple(from_jsonable(a, v) for a, v in zip(args, data, strict=True))
    if origin is dict:
        key_type, value_type = get_args(tp)
        return {key_type(k): from_jsonable(value_type, v) for k, v in data.items()}
    if tp is float and isinstance(data, int):
        return float(data)
    return data


def dumps(obj: Any, **kwargs: Any) -> str:
    return json.dumps(to_jsonable(obj), **kwargs)


def loads(cls: type[T], text: str) -> T:
    return from_jsonable(cls, json.loads(text))
