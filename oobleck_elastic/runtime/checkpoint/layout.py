"""Where a checkpoint lives on disk: `step_<k>/` published, `.partial-step_<k>-<run>/` while it
is written, one `layer_<i>/` per layer with its checksum; atomic writes and the directory syncs
that make a publication durable.

Note: [checkpoint format]
    `<checkpoint.dir>/step_<k>/` is one torch.distributed.checkpoint (DCP) checkpoint of the
    whole model after k optimizer steps, under the model's own names: `model.<param>` (each
    layer module's state_dict) and `optim.<param>.<state>` (exp_avg, step, ...): tensors
    only. It carries per-parameter state, not hyperparameters: a restored layer's optimizer is
    the job's config's (lr, weight_decay, betas, the groups of train.no_weight_decay), built
    by `LayerStore.materialize` like every other replica's, and only its per-parameter state
    comes from the checkpoint, by parameter name, whatever the group split. So a job may
    resume with another lr or weight decay, and a replica restored from the checkpoint steps
    exactly like one rebuilt later by a layer transfer; the LR schedule scales the config's
    lr (`LayerState.base_lrs`) after a restore as for a fresh layer. (Checkpoints written
    before this also hold `optim_groups`, the optimizer's hyperparameters then: never read.)
    Nothing in a checkpoint directory runs code when it is loaded (runtime.checkpoint.dcp_reader Note:
    [checkpoint trust]). Each layer is written once, by its owner, as a DCP
    checkpoint of its own in `layer_<i>/` (`dcp.save(..., no_dist=True)`: no collective, so a
    write never waits for another worker), with its SHA-256 beside it; the step's `.metadata`
    merges the layers', so `dcp_to_torch_save(step_dir, out)` and `dcp.load` read the step as
    one checkpoint, while a worker restores only its own layers' directories, on any layout
    with any number of nodes. The step only copies its layers' state to host memory
    (`host_copy`); a `BackgroundWriter` thread writes and publishes it while training goes on,
    one checkpoint at a time.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "step_dir", "partial_dir", "atomic_write", "layer_dir", "layer_digest",
           "fsync_dir", "remove_partials", "step_numbers"]


MANIFEST = "manifest.json"

MANIFEST_FORMAT = 3

_STEP = re.compile(r"step_(\d+)")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def partial_dir(root: str, step: int, run_id: str) -> str:
    return os.path.join(root, f".partial-step_{step:08d}-{run_id}")


def atomic_write(data: bytes, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def layer_dir(directory: str, index: int) -> str:
    return os.path.join(directory, f"layer_{index:04d}")


def layer_digest(path: str) -> str:
    """SHA-256 over a layer directory's files (names and contents, in name order)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_partials(root: str, run_id: str, before: int | None = None) -> None:
    """Removes run `run_id`'s unpublished checkpoints (of steps before `before`, or all): what its
    writers left when they died or the step was never completed."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        match = re.fullmatch(r"\.partial-step_(\d+)-(.+)", name)
        if match and match.group(2) == run_id and (before is None or int(match.group(1)) < before):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def step_numbers(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)) for m in map(_STEP.fullmatch, os.listdir(root)) if m), reverse=True)
