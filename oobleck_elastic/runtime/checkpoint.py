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

import torch

from oobleck_elastic.runtime.layers import LayerStore

__all__ = ["save_layers", "mark_complete", "latest_checkpoint", "restore_layers"]


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
    count = 0
    for i in indices:
        state = layers[i]
        _atomic_save({"module": state.module.state_dict(),
                      "optimizer": state.optimizer.state_dict() if state.optimizer else None},
                     os.path.join(directory, f"layer_{i:04d}.pt"))
        count += 1
    return count


def mark_complete(root: str, step: int, num_layers: int) -> None:
    path = os.path.join(_step_dir(root, step), "complete.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"step": step, "layers": num_layers}, f)
    os.replace(tmp, path)


def latest_checkpoint(root: str, num_layers: int) -> int | None:
    """The highest step with a complete checkpoint of all `num_layers` layers, or None."""
    if not os.path.isdir(root):
        return None
    steps = []
    for name in os.listdir(root):
        match = re.fullmatch(r"step_(\d+)", name)
        if not match:
            continue
        try:
            with open(os.path.join(root, name, "complete.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if meta.get("layers") == num_layers:
            steps.append(int(match.group(1)))
    return max(steps) if steps else None


def restore_layers(root: str, step: int, layers: LayerStore, indices) -> None:
    """Builds the given layers from the checkpoint of `step` (parameters and optimizer state)."""
    for i in indices:
        data = torch.load(os.path.join(_step_dir(root, step), f"layer_{i:04d}.pt"), weights_only=True)
        state = layers.materialize(i)
        state.module.load_state_dict(data["module"])
        if state.optimizer and data["optimizer"] is not None:
            state.optimizer.load_state_dict(data["optimizer"])
