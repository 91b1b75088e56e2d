"""Reads a job's YAML file and `--set dotted.key=value` overrides into a JobConfig."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from oobleck_elastic.config.parse import parse_section
from oobleck_elastic.config.schema import JobConfig
from oobleck_elastic.errors import ConfigError

__all__ = ["load_config", "apply_overrides", "read_yaml"]


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of a YAML file; syntax errors name the line and column."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} does not exist") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{os.fspath(path)}: YAML syntax error{where}: {problem}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{os.fspath(path)}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    return data


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Returns a copy of `data` with each 'dotted.key=value' applied; values are YAML scalars."""
    result = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects dotted.key=value, got {item!r}")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        node = result
        parts = key.strip().split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: '{'.'.join(parts[:depth + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def load_config(path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """Parses a job file (or the defaults when `path` is None) plus overrides, validated once."""
    data = read_yaml(path) if path is not None else {}
    return parse_section(JobConfig, apply_overrides(data, overrides))
