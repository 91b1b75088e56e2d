"""Checkpoints: the fallback when more nodes fail than the replicas cover.

Layout: `<checkpoint.dir>/step_<k>/layer_<i>.pt` holds layer i after k optimizer steps (its
module state and its optimizer's state), written once, by the layer's owner, atomically (a
temporary file, then rename). `step_<k>/complete.json` is written (atomically) after every
layer file exists, so a checkpoint interrupted by a failure is never read. Files are per layer,
so any layout, with any number of nodes, can restore from any checkpoint.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from oobleck_elastic.runtime.layers import LayerStore

__all__ = ["save_layers", "mark_complete", "checkpoints", "latest_checkpoint", "read_manifest", "load_model_state",
           "restore_layers"]


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_layers(root: str, step: int, layers: LayerStore, indices) -> int:
    """Writes the given layers' state after `step` optimizer steps; returns how many."""
    directory = _step_dir(root, step)
    os.makedirs(directory, exist_ok=True)
    try:  # a checkpoint being rewritten is not complete until it is marked again
        os.remove(os.path.join(directory, "complete.json"))
    except FileNotFoundError:
        pass
    count = 0
    for i in indices:
        state = layers[i]
        _atomic_save({"module": state.module.state_dict(),
                      "optimizer": state.optimizer.state_dict() if state.optimizer else None},
                     os.path.join(directory, f"layer_{i:04d}.pt"))
        count += 1
    return count


def mark_complete(root: str, step: int, num_layers: int, model: Mapping[str, Any] | None = None) -> None:
    """Publishes the checkpoint of `step`; `model` is the ModelSpec's export description."""
    path = os.path.join(_step_dir(root, step), "complete.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"step": step, "layers": num_layers, "model": dict(model or {})}, f)
    os.replace(tmp, path)


def read_manifest(root: str, step: int) -> dict[str, Any]:
    with open(os.path.join(_step_dir(root, step), "complete.json")) as f:
        return json.load(f)


def load_model_state(root: str, step: int, num_layers: int) -> dict[str, torch.Tensor]:
    """The model's whole state_dict at `step` (every layer's module state merged under the
    model's own names; the copies of a tied parameter must agree)."""
    state: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        data = torch.load(os.path.join(_step_dir(root, step), f"layer_{i:04d}.pt"), weights_only=True)
        for name, value in data["module"].items():
            if name in state and not torch.equal(state[name], value):
                raise ValueError(f"checkpoint of step {step}: two layers hold different values for {name!r}")
            state[name] = value
    return state


def checkpoints(root: str) -> list[tuple[int, dict[str, Any]]]:
    """(step, manifest) of every complete checkpoint under `root`, newest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = re.fullmatch(r"step_(\d+)", name)
        if not match:
            continue
        try:
            found.append((int(match.group(1)), read_manifest(root, int(match.group(1)))))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda item: -item[0])


def latest_checkpoint(root: str, num_layers: int) -> int | None:
    """The highest step with a complete checkpoint of all `num_layers` layers, or None."""
    return next((step for step, meta in checkpoints(root) if meta.get("layers") == num_layers), None)


def restore_layers(root: str, step: int, layers: LayerStore, indices) -> None:
    """Builds the given layers from the checkpoint of `step` (parameters and optimizer state)."""
    for i in indices:
        data = torch.load(os.path.join(_step_dir(root, step), f"layer_{i:04d}.pt"), weights_only=True)
        state = layers.materialize(i)
        state.module.load_state_dict(data["module"])
        if state.optimizer and data["optimizer"] is not None:
            state.optimizer.load_state_dict(data["optimizer"])
