"""Checkpoints: the fallback when more nodes fail than the replicas cover, and the final state.

Layout: `<checkpoint.dir>/step_<k>/layer_<i>.pt` holds layer i after k optimizer steps (its
module state under the model's own parameter names, and its optimizer's state), written once,
by the layer's owner, atomically (a temporary file, then rename), with its SHA-256 beside it
(`layer_<i>.sha256`). Files are per layer, so any layout, with any number of nodes, can
restore from any checkpoint.

Note: [checkpoint manifest]
    `step_<k>/complete.json` is the manifest, written last (atomically) by whoever completes
    the set: the run id, the job's digest (model fingerprint, train and data config), the layer
    count, every layer file's checksum and how to export the model. Rewriting a step first
    removes its manifest. A directory without a manifest, or whose manifest names another run
    or another job, or whose files do not match their checksums, is not a checkpoint of this
    run: it is never loaded, so a second run in the same directory cannot restore the first
    one's state, nor a mix of both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.layers import LayerStore

__all__ = ["CheckpointId", "job_digest", "plain", "save_layers", "mark_complete", "checkpoints", "latest_checkpoint",
           "read_manifest", "load_model_state", "restore_layers"]

MANIFEST_FORMAT = 2


@dataclass(frozen=True)
class CheckpointId:
    """Whose checkpoints a run may load (Note: [checkpoint manifest])."""

    run_id: str
    digest: str
    num_layers: int


def plain(value: Any) -> Any:
    """A config dataclass as plain JSON-able data (dicts, lists, scalars)."""
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def job_digest(fingerprint: str, *sections: Any) -> str:
    """A digest of what makes two runs the same training: the model's fingerprint and the
    given config sections (train, data)."""
    blob = json.dumps([fingerprint, *map(plain, sections)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def _atomic_write(data: bytes, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _layer_file(directory: str, index: int) -> str:
    return os.path.join(directory, f"layer_{index:04d}.pt")


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
        buffer = io.BytesIO()
        torch.save({"module": state.module.state_dict(),
                    "optimizer": state.optimizer.state_dict() if state.optimizer else None}, buffer)
        data = buffer.getvalue()
        _atomic_write(data, _layer_file(directory, i))
        _atomic_write(hashlib.sha256(data).hexdigest().encode(), _layer_file(directory, i)[:-3] + ".sha256")
        count += 1
    return count


def mark_complete(root: str, step: int, ident: CheckpointId, model: Mapping[str, Any] | None = None) -> None:
    """Publishes the checkpoint of `step` once every layer file is written: the manifest, last
    (Note: [checkpoint manifest]); `model` is the ModelSpec's export description."""
    directory = _step_dir(root, step)
    sums = []
    for i in range(ident.num_layers):
        try:
            with open(_layer_file(directory, i)[:-3] + ".sha256") as f:
                sums.append(f.read().strip())
        except FileNotFoundError:
            raise OobleckError(f"checkpoint {directory}: layer {i}, written by another node, is not there; "
                               "checkpoint.dir must be a directory every node shares (a network file "
                               "system), not a local one") from None
    manifest = {"format": MANIFEST_FORMAT, "step": step, "run_id": ident.run_id, "digest": ident.digest,
                "layers": ident.num_layers, "sha256": sums, "model": dict(model or {}), "time": time.time()}
    _atomic_write(json.dumps(manifest).encode(), os.path.join(directory, "complete.json"))


def read_manifest(root: str, step: int) -> dict[str, Any]:
    with open(os.path.join(_step_dir(root, step), "complete.json")) as f:
        return json.load(f)


def load_model_state(root: str, step: int, num_layers: int) -> dict[str, torch.Tensor]:
    """The model's whole state_dict at `step` (every layer's module state merged under the
    model's own names; the copies of a tied parameter must agree)."""
    state: dict[str, torch.Tensor] = {}
    sums = read_manifest(root, step)["sha256"]
    for i in range(num_layers):
        data = _load_layer(root, step, i, sums[i])
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


def _intact(root: str, step: int, manifest: Mapping[str, Any]) -> bool:
    for i, expected in enumerate(manifest["sha256"]):
        try:
            with open(_layer_file(_step_dir(root, step), i), "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != expected:
                    return False
        except OSError:
            return False
    return True


def latest_checkpoint(root: str, ident: CheckpointId, *, verify: bool = True) -> int | None:
    """The highest step with a complete checkpoint of this run and job whose files match their
    checksums (with `verify`), or None (Note: [checkpoint manifest])."""
    for step, meta in checkpoints(root):
        if (meta.get("format") == MANIFEST_FORMAT and meta.get("run_id") == ident.run_id
                and meta.get("digest") == ident.digest and meta.get("layers") == ident.num_layers
                and len(meta.get("sha256", ())) == ident.num_layers and (not verify or _intact(root, step, meta))):
            return step
    return None


def _load_layer(root: str, step: int, index: int, expected: str | None = None) -> dict[str, Any]:
    with open(_layer_file(_step_dir(root, step), index), "rb") as f:
        data = f.read()
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise OobleckError(f"checkpoint {_step_dir(root, step)}: layer {index}'s file does not match its "
                           "checksum (changed or damaged since it was written); it cannot be restored")
    return torch.load(io.BytesIO(data), weights_only=True)


def restore_layers(root: str, step: int, layers: LayerStore, indices: Iterable[int]) -> None:
    """Builds the given layers from the checkpoint of `step` (parameters and optimizer state),
    each file checked against the manifest's checksum."""
    sums = read_manifest(root, step)["sha256"]
    for i in indices:
        data = _load_layer(root, step, i, sums[i])
        state = layers.materialize(i)
        state.module.load_state_dict(data["module"])
        if state.optimizer and data["optimizer"] is not None:
            state.optimizer.load_state_dict(data["optimizer"])
