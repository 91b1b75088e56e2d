"""Loading a checkpoint: a worker restores its own layers (each checked against its checksum
as it is read), or the whole model state for an export."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from oobleck_elastic.errors import CheckpointDamaged, ConfigError
from oobleck_elastic.runtime.checkpoint.dcp_reader import empty_tensors, flat_keys, load_tensors, read_metadata
from oobleck_elastic.runtime.checkpoint.layout import layer_digest, layer_dir, step_dir
from oobleck_elastic.runtime.checkpoint.manifest import read_manifest
from oobleck_elastic.runtime.checkpoint.writer import named_state, optimizer_names
from oobleck_elastic.runtime.layers import LayerStore

__all__ = ["load_model_state", "restore_layers"]


def _checked_layer(root: str, step: int, index: int, expected: str) -> str:
    path = layer_dir(step_dir(root, step), index)
    try:
        intact = layer_digest(path) == expected
    except OSError:
        intact = False
    if not intact:
        raise CheckpointDamaged(f"checkpoint {step_dir(root, step)}: layer {index}'s files do not match their "
                           "checksum (changed, damaged or missing since they were written); it cannot be restored")
    return path


def load_model_state(root: str, step: int, num_layers: int) -> dict[str, torch.Tensor]:
    """The model's whole state_dict at `step` (every layer's module state merged under the
    model's own names; the copies of a tied parameter must agree)."""
    state: dict[str, torch.Tensor] = {}
    sums = read_manifest(root, step)["sha256"]
    for i in range(num_layers):
        path = _checked_layer(root, step, i, sums[i])
        metadata = read_metadata(path)  # runtime.checkpoint.dcp_reader Note: [checkpoint trust]
        model = empty_tensors(path, metadata, "model")
        load_tensors(path, metadata, {"model": model})
        for name, value in model.items():
            if name in state and not torch.equal(state[name], value):
                raise ValueError(f"checkpoint of step {step}: two layers hold different values for {name!r}")
            state[name] = value
    return state


def restore_layers(root: str, step: int, layers: LayerStore, indices: Iterable[int]) -> None:
    """Builds the given layers from the checkpoint of `step`: each is materialised by the job's
    config (its optimizer and param_groups too), then its parameters, buffers and per-parameter
    optimizer state are loaded in place by DCP, once its files match the manifest's checksum
    (Note: [checkpoint format]; runtime.checkpoint.dcp_reader Note: [checkpoint trust])."""
    sums = read_manifest(root, step)["sha256"]
    for i in indices:
        path = _checked_layer(root, step, i, sums[i])
        metadata = read_metadata(path)
        state = layers.materialize(i)
        if any(key.startswith("optim.") for key in metadata.state_dict_metadata):
            state.prime_optimizer()  # the optimizer's state tensors exist, to be loaded into
        target = named_state(state)
        _require_optimizer_state(path, metadata, target)
        load_tensors(path, metadata, target)
        state.module.load_state_dict(target["model"])
        if state.optimizer:
            # The optimizer's own param_groups go back unchanged: hyperparameters are the config's.
            index = {name: k for k, name in enumerate(optimizer_names(state))}
            state.optimizer.load_state_dict({
                "state": {index[name]: values for name, values in target.get("optim", {}).items()},
                "param_groups": state.optimizer.state_dict()["param_groups"]})


def _require_optimizer_state(path: str, metadata: Metadata, target: Mapping[str, Any]) -> None:
    """The config's optimizer may want state the checkpoint was written without: an argument
    that adds some (AdamW's amsgrad) was switched on since."""
    for key in flat_keys({"optim": target.get("optim", {})}):
        if key not in metadata.state_dict_metadata:
            raise ConfigError(f"checkpoint {path} holds no {key}, which train.optimizer's arguments need (one "
                               "that adds optimizer state, such as amsgrad, differs from the job that wrote it); "
                               "resume with that job's train.optimizer, or set checkpoint.resume=never")
