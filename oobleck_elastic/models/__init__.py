"""Adapters from the models users have to the layer list the runtime runs (runtime.model):
`hf_model` for a Hugging Face causal LM directory, `sequential_model` for a plain torch model,
and `load_model`, which picks one from the job config's `model` section."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from oobleck_elastic.config import JobConfig
from oobleck_elastic.errors import ConfigError
from oobleck_elastic.models.hf import SUPPORTED_ARCHITECTURES, export_hf, hf_model
from oobleck_elastic.models.sequential import sequential_model
from oobleck_elastic.runtime.model import ModelSpec

__all__ = ["SUPPORTED_ARCHITECTURES", "export_hf", "hf_model", "load_model", "sequential_model"]

_HOW = ("set model.hf to a directory written by save_pretrained, or model.factory to 'module:function' "
        "(a function taking the JobConfig and returning a ModelSpec, or a (ModelSpec, dataset) pair)")


def load_model(cfg: JobConfig) -> tuple[ModelSpec, Any | None]:
    """The job's model and, when its factory brings one, its dataset."""
    section: Mapping[str, Any] = cfg.model
    if "hf" in section:
        extra = sorted(set(section) - {"hf"})
        if extra:
            raise ConfigError(f"unknown key 'model.{extra[0]}': with model.hf the model's own config.json "
                              "describes it; the model section takes only hf")
        if not isinstance(section["hf"], str):
            raise ConfigError(f"model.hf must be a directory path, got {section['hf']!r}")
        return hf_model(section["hf"], seq_len=cfg.data.seq_len), None
    if "factory" in section:
        return _from_factory(section["factory"], cfg)
    raise ConfigError(f"the job names no model: {_HOW}")


def _from_factory(path: Any, cfg: JobConfig) -> tuple[ModelSpec, Any | None]:
    if not isinstance(path, str) or ":" not in path:
        raise ConfigError(f"model.factory must be 'module:function', got {path!r}")
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model.factory {path!r} cannot be imported: {exc}") from exc
    made = fn(cfg)
    spec, data = made if isinstance(made, tuple) else (made, None)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"model.factory {path!r} returned {type(spec).__name__}, not a ModelSpec")
    return spec, data
