"""Reading what is on disk: the manifests, which checkpoint is the newest loadable one for a
run or a resume, and whether a directory holds another job's checkpoints.

Note: [checkpoint manifest]
    A checkpoint is written into a hidden directory of its own (`.partial-step_<k>-<run>`) and
    published by one rename to `step_<k>` once `manifest.json` is in it, written last by
    whoever completes the set: the run id, the job it belongs to (`job`: what must match to
    load it, `digest`: a hash of that), every parameter's dtype and shape, every layer file's
    checksum and how to export the model. So a directory named `step_<k>` is complete, and a
    checkpoint whose writers were all killed is a `.partial-*` directory that nothing loads.
    The in-run fallback loads only checkpoints of this run (or the one it resumed from);
    resuming loads the newest checkpoint of the same job, and names what differs when the
    newest one belongs to another job. Files that do not match their checksums are never loaded.

Note: [newest checkpoint]
    "Newest" is the highest step of the latest start of a run, not the highest step overall: a
    run that went back (checkpoint.load_step, or resume: never in a directory holding a
    longer run) writes lower steps than the run it left, and it is the trajectory the user
    continues. Each start of a run (`instance`: an id and a start time, agreed through the
    store, the first worker's clock; a run id may be used again, torchrun's default is
    "none") trains one trajectory, so within it the higher step is the newer, whichever
    node's clock published it. So resume takes the newest, `keep` retires the oldest, and
    export takes the newest. A run's own checkpoints are those of this start of it, plus the
    one it resumed from. The step is chosen from the manifests (a stat per file); whoever
    loads a layer checks it against its checksum as it loads it, so a restore costs each
    worker its own layers, not the whole checkpoint. A publication found damaged then (a
    checksum, a refused file) is marked so in the store, and no fallback takes it again (the
    step published anew is taken). A checkpoint.dir holding another job's
    checkpoints is refused when a job starts (`check_dir`), and another job's step is never
    replaced: two jobs must not share one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.checkpoint.identity import CheckpointId
from oobleck_elastic.runtime.checkpoint.layout import MANIFEST, MANIFEST_FORMAT, layer_dir, step_dir, step_numbers

__all__ = ["read_manifest", "identity", "checkpoints", "latest_checkpoint", "published", "check_dir", "find_resume"]


def read_manifest(root: str, step: int) -> dict[str, Any]:
    with open(os.path.join(step_dir(root, step), MANIFEST)) as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or manifest.get("step") != step:
        raise ValueError(f"{MANIFEST} does not describe step {step}")
    return manifest


def _recency(item: tuple[int, Mapping[str, Any]]) -> tuple[float, int]:
    """Newer starts first, and within one start the higher step (one start trains one
    trajectory: a step it wrote again holds what it held). Each start's time is one clock's,
    so nodes whose clocks differ do not reorder a run's own checkpoints."""
    step, meta = item
    started = meta.get("instance_started")
    if not isinstance(started, (int, float)):  # older manifests (and no known start): their own time
        started = meta.get("time")
    return (started if isinstance(started, (int, float)) else 0.0), step


def identity(meta: Mapping[str, Any]) -> str:
    """Which publication of a step a manifest is (a step may be published again)."""
    return f"{meta.get('instance')}@{meta.get('time')}"


def checkpoints(root: str) -> list[tuple[int, dict[str, Any]]]:
    """(step, manifest) of every published checkpoint under `root` whose manifest reads, the
    newest first: the last published, not the highest step (Note: [newest checkpoint])."""
    found = []
    for step in step_numbers(root):
        try:
            found.append((step, read_manifest(root, step)))
        except (OSError, ValueError):
            continue
    return sorted(found, key=_recency, reverse=True)


def _loadable(meta: Mapping[str, Any], ident: CheckpointId) -> bool:
    return (meta.get("format") == MANIFEST_FORMAT and meta.get("digest") == ident.digest
            and meta.get("layers") == ident.num_layers and len(meta.get("sha256", ())) == ident.num_layers)


def _ours(meta: Mapping[str, Any], step: int, ident: CheckpointId) -> bool:
    """Whether a checkpoint was written by this start of the run, or is the one it resumed
    from (Note: [newest checkpoint]); a manifest without `instance` goes by its run id."""
    if (meta.get("run_id"), step) == ident.resumed:
        return True
    if ident.instance is not None and meta.get("instance") is not None:
        return meta["instance"] == ident.instance
    return meta.get("run_id") == ident.run_id


def _layers_present(root: str, step: int, meta: Mapping[str, Any]) -> bool:
    """Every layer's files are there (and of the sizes written, where the manifest says):
    a stat per file, not a read; the checksums are checked by whoever loads a layer."""
    sizes = meta.get("sizes")
    for i in range(len(meta.get("sha256", ()))):
        path = layer_dir(step_dir(root, step), i)
        try:
            have = {name: os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)}
        except OSError:
            return False
        if ".metadata" not in have or not os.path.exists(path + ".sha256"):
            return False
        if sizes is not None and have != sizes[i]:
            return False
    return True


def latest_checkpoint(root: str, ident: CheckpointId, *, damaged: Mapping[int, str] | None = None) -> int | None:
    """The fallback of a running job: the newest checkpoint of this run (or the one it resumed
    from) and job whose files are all there, but those `damaged` names (step -> the identity
    of the publication found damaged when it was loaded), or None. Chosen from the manifests;
    every worker checks the layers it loads against their checksums as it loads them (Note:
    [checkpoint manifest])."""
    damaged = damaged or {}
    for step, meta in checkpoints(root):
        if damaged.get(step) != identity(meta) and _ours(meta, step, ident) and _loadable(meta, ident) and \
                _layers_present(root, step, meta):
            return step
    return None


def published(root: str, step: int, ident: CheckpointId, damaged: Mapping[int, str] | None = None) -> bool:
    """Whether `step_<step>` under `root` is a checkpoint of this run (or the one it resumed
    from) and job, and not the publication `damaged` names: complete by construction (Note:
    [checkpoint manifest]); its files are checked when they are loaded."""
    try:
        meta = read_manifest(root, step)
    except (OSError, ValueError):
        return False
    return (damaged or {}).get(step) != identity(meta) and _ours(meta, step, ident) and _loadable(meta, ident)


def check_dir(root: str, ident: CheckpointId) -> None:
    """A job starts only in a checkpoint.dir that holds no other job's checkpoints, whatever
    checkpoint.resume says: a checkpoint of the same step would be replaced, and a node whose
    directory is another one's would load it. One OobleckError naming the first it found."""
    for step, meta in checkpoints(root):
        if meta.get("digest") != ident.digest:
            differ = _differences(meta, ident) or ["the checkpoint's job digest differs"]
            raise OobleckError(f"checkpoint.dir {root!r} holds a checkpoint of another job ({step_dir(root, step)}, "
                               f"run {meta.get('run_id')!r}: {'; '.join(differ)}); give this job its own "
                               "checkpoint.dir, or move the other job's checkpoints away")


def _differences(meta: Mapping[str, Any], ident: CheckpointId) -> list[str]:
    theirs = meta.get("job") or {}
    out = [f"{k} = {ident.job.get(k)!r} here, {theirs.get(k)!r} in the checkpoint"
           for k in sorted(set(theirs) | set(ident.job)) if k != "model" and theirs.get(k) != ident.job.get(k)]
    if theirs.get("model") != ident.job.get("model"):
        params = meta.get("params") or {}
        shapes = [f"{name} is {ident.params.get(name, 'absent')} here, {params.get(name, 'absent')} in the checkpoint"
                  for name in [*ident.params, *(n for n in params if n not in ident.params)]  # model order
                  if params.get(name) != ident.params.get(name)]
        detail = "; ".join(shapes[:3]) + (f" (and {len(shapes) - 3} more)" if len(shapes) > 3 else "")
        out.insert(0, f"the model differs ({detail or 'same parameters, other architecture'}; "
                      f"{ident.job.get('model')} here, {theirs.get('model')} in the checkpoint)")
    if meta.get("layers") != ident.num_layers and not out:
        out.append(f"{ident.num_layers} layers here, {meta.get('layers')} in the checkpoint")
    return out


def find_resume(root: str, ident: CheckpointId, *, load_step: int | None, max_step: int) -> tuple[int, dict] | None:
    """The checkpoint a starting job resumes from: `load_step`'s, else the newest one in
    `root`; None when there is none. A checkpoint that cannot be resumed (another job, a
    damaged manifest or file, a step beyond the run) is an OobleckError saying what differs and
    what to do; nothing is written (Note: [checkpoint manifest])."""
    steps = step_numbers(root)
    if load_step is not None and load_step not in steps:
        have = ", ".join(map(str, sorted(steps))) or "none"
        raise OobleckError(f"checkpoint.load_step={load_step}: {root!r} holds no checkpoint of step {load_step} "
                           f"(steps found: {have})")
    if not steps:
        return None
    newest = checkpoints(root)  # the newest published one: the trajectory the user left (Note: [newest checkpoint])
    step = load_step if load_step is not None else (newest[0][0] if newest else steps[0])
    where = step_dir(root, step)
    how = ("set checkpoint.load_step to another step, checkpoint.resume=never to start afresh, or another "
           "checkpoint.dir")
    try:
        meta = read_manifest(root, step)
    except (OSError, ValueError) as exc:
        raise OobleckError(f"cannot resume from {where}: its {MANIFEST} is damaged or missing "
                           f"({str(exc).splitlines()[0][:120]}); {how}") from exc
    if meta.get("format") != MANIFEST_FORMAT:
        raise OobleckError(f"cannot resume from {where}: it was written by another version of oobleck_elastic "
                           f"(manifest format {meta.get('format')!r}, this one reads {MANIFEST_FORMAT}); {how}")
    differ = _differences(meta, ident)
    if differ:
        raise OobleckError(f"cannot resume from {where}: it belongs to another job: {'; '.join(differ)}. Start "
                           f"this job with the same model and train/data settings, or {how}")
    if step > max_step:
        raise OobleckError(f"cannot resume from {where}: it is after step {step} but train.steps is {max_step}; "
                           f"raise train.steps to train further, or {how}")
    if not _layers_present(root, step, meta):
        raise OobleckError(f"cannot resume from {where}: a layer file is missing or is not the size it was written "
                           f"(changed or damaged since); {how}")
    return step, meta
