"""Checkpoints: what a stopped job resumes from, the fallback when more nodes fail than the
replicas cover, and the final state.

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
    Nothing in a checkpoint directory runs code when it is loaded (runtime.dcp_reader Note:
    [checkpoint trust]). Each layer is written once, by its owner, as a DCP
    checkpoint of its own in `layer_<i>/` (`dcp.save(..., no_dist=True)`: no collective, so a
    write never waits for another worker), with its SHA-256 beside it; the step's `.metadata`
    merges the layers', so `dcp_to_torch_save(step_dir, out)` and `dcp.load` read the step as
    one checkpoint, while a worker restores only its own layers' directories, on any layout
    with any number of nodes. The step only copies its layers' state to host memory
    (`host_copy`); a `BackgroundWriter` thread writes and publishes it while training goes on,
    one checkpoint at a time.

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

import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from oobleck_elastic.errors import CheckpointDamaged, ConfigError, OobleckError
from oobleck_elastic.runtime.background_writer import BackgroundWriter
from oobleck_elastic.runtime.dcp_reader import empty_tensors, flat_keys, load_tensors, read_metadata
from oobleck_elastic.runtime.layers import LayerState, LayerStore
from oobleck_elastic.runtime.model import DTYPES, ModelSpec, model_fingerprint, state_shapes

__all__ = ["CheckpointId", "CheckpointUnreadable", "checkpoint_id", "job_key", "job_digest", "plain", "save_layers",
           "mark_complete", "checkpoints", "latest_checkpoint", "published", "identity", "check_dir", "find_resume",
           "remove_partials", "read_manifest", "load_model_state", "restore_layers", "host_copy", "BackgroundWriter"]

logger = logging.getLogger(__name__)
# Each layer's owner saves and loads alone (no_dist): DCP says it assumes so, at every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 3
_STEP = re.compile(r"step_(\d+)")


class CheckpointUnreadable(RuntimeError):
    """A checkpoint a generation restores did not load: a failed build, recovered like any
    other. `damaged`: a file does not match its checksum or holds what is never written
    (CheckpointDamaged), so the step is marked damaged and the next fallback takes the one
    before it; anything else (a file not there yet on this node's mount, out of memory) is
    only tried again (Note: [newest checkpoint])."""

    def __init__(self, step: int, why: str, damaged: bool = False) -> None:
        then = "the fallback takes the one before it" if damaged else "it is tried again"
        super().__init__(f"the checkpoint of step {step} did not load ({why}); {then}")
        self.step, self.why, self.damaged = step, why, damaged

    @classmethod
    def of(cls, step: int, exc: BaseException) -> CheckpointUnreadable:
        return cls(step, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                   damaged=isinstance(exc, CheckpointDamaged))


def plain(value: Any) -> Any:
    """A config dataclass as plain JSON-able data (dicts, lists, scalars)."""
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def job_key(model: str, cfg, samples: int) -> dict[str, Any]:
    """What a checkpoint must share with a job to be loaded by it (flat dotted keys): the model
    (`name:fingerprint`), and what fixes the meaning of a step: the global batch, the seed and
    the data (which samples step k takes), the precision and the optimizer (the state's shapes).
    Everything else (train.steps, the lr, the schedule, clipping, microbatches, the node count)
    may change between a job and its resumption."""
    train, data = cfg.train, cfg.data
    # "train.dtype" is the master parameters' dtype, under the key jobs had before
    # train.precision, so their checkpoints still match; only bf16-mixed adds a key.
    key = {"model": model, "train.global_batch_size": train.global_batch_size, "train.seed": train.seed,
           "train.dtype": train.param_dtype, "train.optimizer.name": train.optimizer.name,
           "data.seq_len": data.seq_len, "data.shuffle": data.shuffle, "data.samples": samples}
    if train.mixed:
        key["train.precision"] = train.precision
    return key


def job_digest(job: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(plain(job), sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CheckpointId:
    """Whose checkpoints a run writes and may load (Note: [checkpoint manifest])."""

    run_id: str
    job: Mapping[str, Any] = field(compare=False, hash=False)
    """job_key(): what must match to load a checkpoint."""
    num_layers: int
    params: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Every state_dict entry's 'dtype[shape]' (runtime.model.state_shapes)."""
    resumed: tuple[str, int] | None = None
    """(run id, step) of the checkpoint this run resumed from: the fallback may load it too."""
    instance: str | None = None
    """This start of the run (Note: [newest checkpoint]): a run id may be used again (torchrun's
    default is "none"), and one run's fallback must not load another start's checkpoints."""
    instance_started: float | None = None
    """When this start of the run began (one wall clock: the first worker's), which orders
    checkpoints of different starts."""

    @property
    def digest(self) -> str:
        return job_digest(self.job)


def checkpoint_id(run_id: str, spec: ModelSpec, cfg, samples: int) -> CheckpointId:
    """The CheckpointId of a run of `spec` under `cfg` on a dataset of `samples` samples."""
    dtype = DTYPES[cfg.train.param_dtype]  # checkpoints hold the master state
    job = job_key(f"{spec.name}:{model_fingerprint(spec, dtype)}", cfg, samples)
    return CheckpointId(run_id, job, spec.num_layers, params=state_shapes(spec, dtype))


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def _partial_dir(root: str, step: int, run_id: str) -> str:
    return os.path.join(root, f".partial-step_{step:08d}-{run_id}")


def _atomic_write(data: bytes, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _layer_dir(directory: str, index: int) -> str:
    return os.path.join(directory, f"layer_{index:04d}")


def _layer_digest(path: str) -> str:
    """SHA-256 over a layer directory's files (names and contents, in name order)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _copied(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def _named_state(state: LayerState) -> dict[str, Any]:
    """A layer's checkpoint state under the model's own names (live tensors): `model` is the
    module's state_dict, `optim` the optimizer's per-parameter state keyed by parameter name;
    no hyperparameters (Note: [checkpoint format])."""
    out: dict[str, Any] = {"model": state.module.state_dict()}
    if state.optimizer:
        order = _optimizer_names(state)
        out["optim"] = {order[index]: values for index, values in state.optimizer.state_dict()["state"].items()}
    return out


def _optimizer_names(state: LayerState) -> list[str]:
    """The names of the optimizer's parameters in the order its state_dict numbers them (group
    after group: the numbers change with the groups, the names do not)."""
    assert state.optimizer is not None, "called for a layer with an optimizer"
    name_of = {id(p): n for n, p in state.named_params}
    return [name_of[id(p)] for group in state.optimizer.param_groups for p in group["params"]]


def host_copy(state: LayerState) -> dict[str, Any]:
    """What a checkpoint holds of one layer (`_named_state`), copied to host memory: the live
    tensors go on training while the copy is written."""
    return _copied(_named_state(state))


def save_layers(root: str, step: int, states: Mapping[int, Mapping[str, Any]], run_id: str) -> int:
    """Writes layer states (`host_copy`) after `step` optimizer steps into the run's partial
    checkpoint of that step, each as a torch.distributed.checkpoint directory with its digest
    beside it; returns how many (Note: [checkpoint manifest])."""
    directory = _partial_dir(root, step, run_id)
    os.makedirs(directory, exist_ok=True)
    count = 0
    for i, state in states.items():
        path = _layer_dir(directory, i)
        if os.path.exists(path + ".sha256"):  # an earlier attempt's, in this run
            os.remove(path + ".sha256")
        shutil.rmtree(path, ignore_errors=True)
        dcp.save(dict(state), storage_writer=FileSystemWriter(path), no_dist=True)
        _atomic_write(_layer_digest(path).encode(), path + ".sha256")
        count += 1
    return count


def _merge_metadata(directory: str, num_layers: int) -> None:
    """One `.metadata` for the whole step, pointing into the layers' files, so DCP tools
    (`dcp_to_torch_save`, `dcp.load`) read the step as one checkpoint (Note: [checkpoint format])."""
    tensors, storage = {}, {}
    planner: dict[str, Any] = {}
    for i in range(num_layers):
        meta = read_metadata(_layer_dir(directory, i))
        tensors.update(meta.state_dict_metadata)
        planner.update(meta.planner_data or {})
        for index, info in meta.storage_data.items():
            storage[index] = dataclasses.replace(info, relative_path=f"layer_{i:04d}/{info.relative_path}")
    merged = Metadata(state_dict_metadata=tensors, planner_data=planner, storage_data=storage)
    buffer = io.BytesIO()
    pickle.dump(merged, buffer)  # DCP's own metadata format
    _atomic_write(buffer.getvalue(), os.path.join(directory, ".metadata"))


def mark_complete(root: str, step: int, ident: CheckpointId, model: Mapping[str, Any] | None = None,
                  keep: int | None = None, protect: Callable[[], Iterable[int]] = tuple) -> None:
    """Publishes the checkpoint of `step` once every layer file is written: the manifest, then
    one rename (Note: [checkpoint manifest]); `model` is the ModelSpec's export description.
    With `keep`, only the newest `keep` checkpoints of this job stay, and those `protect()`
    names (a step being restored) are not retired."""
    partial = _partial_dir(root, step, ident.run_id)
    sums, sizes = [], []
    for i in range(ident.num_layers):
        try:
            with open(_layer_dir(partial, i) + ".sha256") as f:
                sums.append(f.read().strip())
            path = _layer_dir(partial, i)
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
    _atomic_write(json.dumps(manifest).encode(), os.path.join(partial, MANIFEST))
    final = _step_dir(root, step)
    _refuse_other_job(root, step, ident)
    if os.path.exists(final):  # another run's step k of this job (or a rewrite): replaced as a whole
        aside = os.path.join(root, f".replaced-step_{step:08d}-{os.getpid()}")
        os.rename(final, aside)
        os.rename(partial, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(partial, final)
    _fsync_dir(root)
    remove_partials(root, ident.run_id, before=step)
    if keep:  # the newest, not the highest steps (Note: [newest checkpoint])
        ours = [s for s, meta in checkpoints(root) if meta.get("digest") == ident.digest]
        in_use = set(protect()) if ours[keep:] else set()
        for old in (s for s in ours[keep:] if s not in in_use):
            shutil.rmtree(_step_dir(root, old), ignore_errors=True)


def _refuse_other_job(root: str, step: int, ident: CheckpointId) -> None:
    """Another job's checkpoint of `step` is never replaced: two jobs sharing a checkpoint.dir
    are refused when they start (`check_dir`); this is the last guard, for two started at once."""
    try:
        meta = read_manifest(root, step)
    except (OSError, ValueError):
        return
    if meta.get("digest") != ident.digest:
        raise OobleckError(f"{_step_dir(root, step)} belongs to another job (run {meta.get('run_id')!r}); it is "
                           "not replaced, and this checkpoint is not published: give each job its own "
                           "checkpoint.dir")


def _fsync_dir(path: str) -> None:
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


def read_manifest(root: str, step: int) -> dict[str, Any]:
    with open(os.path.join(_step_dir(root, step), MANIFEST)) as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or manifest.get("step") != step:
        raise ValueError(f"{MANIFEST} does not describe step {step}")
    return manifest


def _steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)) for m in map(_STEP.fullmatch, os.listdir(root)) if m), reverse=True)


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
    for step in _steps(root):
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
        path = _layer_dir(_step_dir(root, step), i)
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
            raise OobleckError(f"checkpoint.dir {root!r} holds a checkpoint of another job ({_step_dir(root, step)}, "
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
    steps = _steps(root)
    if load_step is not None and load_step not in steps:
        have = ", ".join(map(str, sorted(steps))) or "none"
        raise OobleckError(f"checkpoint.load_step={load_step}: {root!r} holds no checkpoint of step {load_step} "
                           f"(steps found: {have})")
    if not steps:
        return None
    newest = checkpoints(root)  # the newest published one: the trajectory the user left (Note: [newest checkpoint])
    step = load_step if load_step is not None else (newest[0][0] if newest else steps[0])
    where = _step_dir(root, step)
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


def _checked_layer(root: str, step: int, index: int, expected: str) -> str:
    path = _layer_dir(_step_dir(root, step), index)
    try:
        intact = _layer_digest(path) == expected
    except OSError:
        intact = False
    if not intact:
        raise CheckpointDamaged(f"checkpoint {_step_dir(root, step)}: layer {index}'s files do not match their "
                           "checksum (changed, damaged or missing since they were written); it cannot be restored")
    return path


def load_model_state(root: str, step: int, num_layers: int) -> dict[str, torch.Tensor]:
    """The model's whole state_dict at `step` (every layer's module state merged under the
    model's own names; the copies of a tied parameter must agree)."""
    state: dict[str, torch.Tensor] = {}
    sums = read_manifest(root, step)["sha256"]
    for i in range(num_layers):
        path = _checked_layer(root, step, i, sums[i])
        metadata = read_metadata(path)  # runtime.dcp_reader Note: [checkpoint trust]
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
    (Note: [checkpoint format]; runtime.dcp_reader Note: [checkpoint trust])."""
    sums = read_manifest(root, step)["sha256"]
    for i in indices:
        path = _checked_layer(root, step, i, sums[i])
        metadata = read_metadata(path)
        state = layers.materialize(i)
        if any(key.startswith("optim.") for key in metadata.state_dict_metadata):
            state.prime_optimizer()  # the optimizer's state tensors exist, to be loaded into
        target = _named_state(state)
        _require_optimizer_state(path, metadata, target)
        load_tensors(path, metadata, target)
        state.module.load_state_dict(target["model"])
        if state.optimizer:
            # The optimizer's own param_groups go back unchanged: hyperparameters are the config's.
            index = {name: k for k, name in enumerate(_optimizer_names(state))}
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
