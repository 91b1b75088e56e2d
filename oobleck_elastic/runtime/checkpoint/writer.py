"""Writing a checkpoint: each layer's owner copies its state to host memory (`host_copy`) and
writes it alone (`save_layers`); whoever completes the set writes the manifest and publishes
the step (`mark_complete`)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.checkpoint.dcp_reader import read_metadata
from oobleck_elastic.runtime.checkpoint.identity import CheckpointId
from oobleck_elastic.runtime.checkpoint.layout import (
    MANIFEST,
    MANIFEST_FORMAT,
    atomic_write,
    fsync_dir,
    layer_digest,
    layer_dir,
    partial_dir,
    remove_partials,
    step_dir,
)
from oobleck_elastic.runtime.checkpoint.manifest import checkpoints, read_manifest
from oobleck_elastic.runtime.layers import LayerState

__all__ = ["named_state", "optimizer_names", "host_copy", "save_layers", "mark_complete"]


def _copied(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def named_state(state: LayerState) -> dict[str, Any]:
    """A layer's checkpoint state under the model's own names (live tensors): `model` is the
    module's state_dict, `optim` the optimizer's per-parameter state keyed by parameter name;
    no hyperparameters (Note: [checkpoint format])."""
    out: dict[str, Any] = {"model": state.module.state_dict()}
    if state.optimizer:
        order = optimizer_names(state)
        out["optim"] = {order[index]: values for index, values in state.optimizer.state_dict()["state"].items()}
    return out


def optimizer_names(state: LayerState) -> list[str]:
    """The names of the optimizer's parameters in the order its state_dict numbers them (group
    after group: the numbers change with the groups, the names do not)."""
    assert state.optimizer is not None, "called for a layer with an optimizer"
    name_of = {id(p): n for n, p in state.named_params}
    return [name_of[id(p)] for group in state.optimizer.param_groups for p in group["params"]]


def host_copy(state: LayerState) -> dict[str, Any]:
    """What a checkpoint holds of one layer (`named_state`), copied to host memory: the live
    tensors go on training while the copy is written."""
    return _copied(named_state(state))


def save_layers(root: str, step: int, states: Mapping[int, Mapping[str, Any]], run_id: str) -> int:
    """Writes layer states (`host_copy`) after `step` optimizer steps into the run's partial
    checkpoint of that step, each as a torch.distributed.checkpoint directory with its digest
    beside it; returns how many (Note: [checkpoint manifest])."""
    directory = partial_dir(root, step, run_id)
    os.makedirs(directory, exist_ok=True)
    count = 0
    for i, state in states.items():
        path = layer_dir(directory, i)
        if os.path.exists(path + ".sha256"):  # an earlier attempt's, in this run
            os.remove(path + ".sha256")
        shutil.rmtree(path, ignore_errors=True)
        dcp.save(dict(state), storage_writer=FileSystemWriter(path), no_dist=True)
        atomic_write(layer_digest(path).encode(), path + ".sha256")
        count += 1
    return count


def _merge_metadata(directory: str, num_layers: int) -> None:
    """One `.metadata` for the whole step, pointing into the layers' files, so DCP tools
    (`dcp_to_torch_save`, `dcp.load`) read the step as one checkpoint (Note: [checkpoint format])."""
    tensors, storage = {}, {}
    planner: dict[str, Any] = {}
    for i in range(num_layers):
        meta = read_metadata(layer_dir(directory, i))
        tensors.update(meta.state_dict_metadata)
        planner.update(meta.planner_data or {})
        for index, info in meta.storage_data.items():
            storage[index] = dataclasses.replace(info, relative_path=f"layer_{i:04d}/{info.relative_path}")
    merged = Metadata(state_dict_metadata=tensors, planner_data=planner, storage_data=storage)
    buffer = io.BytesIO()
    pickle.dump(merged, buffer)  # DCP's own metadata format
    atomic_write(buffer.getvalue(), os.path.join(directory, ".metadata"))


def mark_complete(root: str, step: int, ident: CheckpointId, model: Mapping[str, Any] | None = None,
                  keep: int | None = None, protect: Callable[[], Iterable[int]] = tuple) -> None:
    """Publishes the checkpoint of `step` once every layer file is written: the manifest, then
    one rename (Note: [checkpoint manifest]); `model` is the ModelSpec's export description.
    With `keep`, only the newest `keep` checkpoints of this job stay, and those `protect()`
    names (a step being restored) are not retired."""
    partial = partial_dir(root, step, ident.run_id)
    sums, sizes = [], []
    for i in range(ident.num_layers):
        try:
            with open(layer_dir(partial, i) + ".sha256") as f:
                sums.append(f.read().strip())
            path = layer_dir(partial, i)
            sizes.append({name: os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)})
        except FileNotFoundError as exc:
            raise OobleckError(f"checkpoint {partial}: layer {i}, written by another node, is not there; "
                               "checkpoint.dir must be a directory every node shares (a network file "
                               "system), not a local one") from exc
    manifest = {"format": MANIFEST_FORMAT, "step": step, "run_id": ident.run_id, "digest": ident.digest,
                "job": dict(ident.job), "params": dict(ident.params), "layers": ident.num_layers,
                "sha256": sums, "sizes": sizes, "model": dict(model or {}), "time": time.time(),
                "resumed_from": list(ident.resumed) if ident.resumed else None, "instance": ident.instance,
                "instance_started": ident.instance_started}
    _merge_metadata(partial, ident.num_layers)
    atomic_write(json.dumps(manifest).encode(), os.path.join(partial, MANIFEST))
    final = step_dir(root, step)
    _refuse_other_job(root, step, ident)
    if os.path.exists(final):  # another run's step k of this job (or a rewrite): replaced as a whole
        aside = os.path.join(root, f".replaced-step_{step:08d}-{os.getpid()}")
        os.rename(final, aside)
        os.rename(partial, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(partial, final)
    fsync_dir(root)
    remove_partials(root, ident.run_id, before=step)
    if keep:  # the newest, not the highest steps (Note: [newest checkpoint])
        ours = [s for s, meta in checkpoints(root) if meta.get("digest") == ident.digest]
        in_use = set(protect()) if ours[keep:] else set()
        for old in (s for s in ours[keep:] if s not in in_use):
            shutil.rmtree(step_dir(root, old), ignore_errors=True)


def _refuse_other_job(root: str, step: int, ident: CheckpointId) -> None:
    """Another job's checkpoint of `step` is never replaced: two jobs sharing a checkpoint.dir
    are refused when they start (`check_dir`); this is the last guard, for two started at once."""
    try:
        meta = read_manifest(root, step)
    except (OSError, ValueError):
        return
    if meta.get("digest") != ident.digest:
        raise OobleckError(f"{step_dir(root, step)} belongs to another job (run {meta.get('run_id')!r}); it is "
                           "not replaced, and this checkpoint is not published: give each job its own "
                           "checkpoint.dir")
