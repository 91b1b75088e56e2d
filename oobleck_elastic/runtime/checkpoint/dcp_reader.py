"""Reads a torch.distributed.checkpoint (DCP) directory as data: its metadata and its tensors,
without running anything written in it. runtime.checkpoint loads every layer through it.

Note: [checkpoint trust]
    Loading a checkpoint runs no code from it: a worker restoring a layer (on resume or in the
    in-run fallback), the exporter and chaos's comparison (`load_model_state`) read a checkpoint
    directory as data. DCP alone would not: its FileSystemReader.read_metadata is pickle.load,
    and it reads an entry that is not a tensor with torch.load(weights_only=False); either runs
    whatever the file says, as whoever loads it. So:
    * `.metadata` is unpickled with only the classes DCP's metadata is made of allowed
      (`_METADATA_GLOBALS`: building or calling them does nothing else); whatever else it
      names is refused. torch's weights-only unpickler would do the same, but it does not read
      pickle protocol 4 (FRAME, MEMOIZE, STACK_GLOBAL), which DCP writes.
    * every entry loaded must be a tensor in that metadata (`load_tensors`): a checkpoint holds
      nothing else (runtime/checkpoint/layout.py Note: [checkpoint format]); entries not asked for, such
      as older checkpoints' `optim_groups`, are never read.
    * DCP reads tensors with torch.load(weights_only=True), and here only from files inside
      the directory: a storage path that leads elsewhere is refused.
    DCP then loads by the metadata checked here (`_CheckedReader`), without reading the file
    again. What this does not give: the SHA-256 sums sit beside the files, so they catch
    damage, not someone who rewrites both; whoever can write checkpoint.dir still chooses the
    weights a job resumes with. DCP's own tools (`dcp_to_torch_save`, `dcp.load`) unpickle
    `.metadata` and non-tensor entries unchecked: use them on checkpoints you trust only.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from oobleck_elastic.errors import CheckpointDamaged, OobleckError

__all__ = ["read_metadata", "flat_keys", "load_tensors", "empty_tensors"]


# What DCP's `.metadata` pickle is made of, as torch 2.13 writes it: its dataclasses,
# torch.Size, dtypes and layouts, and the path its writer records (Note: [checkpoint trust]).
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (g.__module__, g.__qualname__): g
    for g in (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
              _MEM_FORMAT_ENCODING, StorageMeta, MetadataIndex, _StorageInfo, torch.Size,
              torch.serialization._get_layout, pathlib.PurePosixPath, pathlib.PosixPath)}
_METADATA_GLOBALS.update({("pathlib", "PurePosixPath"): pathlib.PurePosixPath,  # as Pythons before 3.13 name them
                          ("pathlib", "PosixPath"): pathlib.PosixPath})
_METADATA_GLOBALS.update({("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _METADATA_GLOBALS[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, no part of DCP's metadata") from None


def _refused(path: str, why: str) -> CheckpointDamaged:
    return CheckpointDamaged(f"checkpoint {path} is refused: {why}. Nothing oobleck_elastic writes looks like that: "
                        "find out who else can write checkpoint.dir, and load another checkpoint")


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of the checkpoint directory `path`, unpickled with nothing but DCP's
    metadata classes allowed, its files all inside `path` (Note: [checkpoint trust])."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except Exception as exc:  # a crafted or damaged pickle fails in any way
            detail = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            raise _refused(path, f"its .metadata is not plain DCP metadata ({detail})") from exc
    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)):
        raise _refused(path, "its .metadata is not DCP metadata")
    for info in metadata.storage_data.values():
        where = getattr(info, "relative_path", None)
        if not (isinstance(info, _StorageInfo) and isinstance(where, str) and where not in ("", ".", "..")
                and os.path.basename(where) == where):
            raise _refused(path, f"it reads {where!r}, outside its own directory")
    return metadata


def flat_keys(tree: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    """A nested state dict's keys as DCP flattens them (`optim.<param>.<state>`)."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _require_tensors(path: str, metadata: Metadata, keys: Iterable[str]) -> dict[str, TensorStorageMetadata]:
    """The entries of `keys`, each checked to be a tensor's."""
    entries = {}
    for key in keys:
        entry = metadata.state_dict_metadata.get(key)
        if entry is None:
            raise OobleckError(f"checkpoint {path} holds no {key}; it is a checkpoint of another model")
        if not isinstance(entry, TensorStorageMetadata):
            raise _refused(path, f"its {key} is not a tensor")
        entries[key] = entry
    return entries


def empty_tensors(path: str, metadata: Metadata, prefix: str) -> dict[str, torch.Tensor]:
    """A CPU tensor, its contents undefined, for each entry under `prefix.` in `metadata`,
    keyed by the rest of its name: what `load_tensors` fills."""
    keys = [key for key in metadata.state_dict_metadata if key.startswith(f"{prefix}.")]
    entries = _require_tensors(path, metadata, keys)  # before their sizes are read
    return {key.removeprefix(f"{prefix}."): torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in entries.items()}


class _CheckedReader(FileSystemReader):
    """A checkpoint directory whose metadata `read_metadata` has read and checked: DCP loads by
    it and does not read (unpickle) `.metadata` again (Note: [checkpoint trust])."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


def load_tensors(path: str, metadata: Metadata, target: dict[str, Any]) -> None:
    """Loads `target` (a nested state dict of tensors) in place from the checkpoint directory
    `path`, whose metadata `read_metadata` returned; each entry must be a tensor there."""
    _require_tensors(path, metadata, flat_keys(target))
    dcp.load(target, storage_reader=_CheckedReader(path, metadata), no_dist=True)
