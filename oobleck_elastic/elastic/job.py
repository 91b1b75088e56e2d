"""What a worker knows of its job before the first generation: the description every node
must share (so a node started with another model, config or worker count, or whose copy of
model.hf or data.tokens holds other contents, is refused), the profile every
worker plans from (measured once, by the first worker of the first node, and published in the
store), and the pipeline templates planned from it (the same on every worker)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.protocol import WorkerSide
from oobleck_elastic.planning import ModelProfile, TemplateSet, plan_templates
from oobleck_elastic.planning.job import make_cluster
from oobleck_elastic.planning.values import from_jsonable, to_jsonable
from oobleck_elastic.runtime.checkpoint import plain
from oobleck_elastic.runtime.devices import resolve_device
from oobleck_elastic.runtime.model import DTYPES, ModelSpec, model_fingerprint
from oobleck_elastic.runtime.profiler import load_or_profile

__all__ = ["WorkerIdentity", "content_digest", "job_description", "measure", "plan_run", "templates"]

LOCAL_KEYS = ("planner.profile_dir", "planner.profile_iterations", "checkpoint.dir")
"""A machine's own paths and its profiling effort may differ between nodes."""


@dataclass(frozen=True)
class WorkerIdentity:
    """Who a worker is: its run, node, local rank, and its node's worker count."""

    run_id: str
    node: int
    local_rank: int
    local_world_size: int


def _flatten(prefix: str, value: object) -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _flatten(f"{prefix}.{key}", sub).items()}
    return {prefix: value}


SAMPLED_BLOCKS = 256  # blocks of a large file read for its digest (1 MiB at most)
BLOCK = 4096


def content_digest(path: str) -> str:
    """A digest of a file's or directory's contents that reads at most ~1 MiB a file: its size,
    its first and last blocks (a safetensors header, say) and blocks spread evenly through it.
    Two nodes whose model.hf or data.tokens hold other weights or other tokens differ almost
    everywhere, so a few hundred blocks tell them apart without reading gigabytes."""
    digest = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(_visible_files(path))
    for name in files:
        size = os.path.getsize(name)
        digest.update(f"{os.path.relpath(name, path)}\0{size}\0".encode())
        with open(name, "rb") as f:
            if size <= SAMPLED_BLOCKS * BLOCK:
                digest.update(f.read())
                continue
            for k in range(SAMPLED_BLOCKS):
                f.seek((size - BLOCK) * k // (SAMPLED_BLOCKS - 1))
                digest.update(f.read(BLOCK))
    return digest.hexdigest()[:16]


def _visible_files(root: str) -> list[str]:
    """A directory's files but hidden ones and their folders: a download's bookkeeping
    (Hugging Face's `.cache/`, with the time of the download) is not what the job loads."""
    out = []
    for folder, folders, names in os.walk(root):
        folders[:] = [d for d in folders if not d.startswith(".")]
        out += [os.path.join(folder, n) for n in names if not n.startswith(".") and not n.endswith(".lock")]
    return out


def _contents(cfg: JobConfig) -> dict[str, object]:
    """What the job reads from files every node has its own copy of: their digests."""
    paths = {"model.hf": cfg.model.get("hf"),
             "data.tokens": cfg.data.tokens, "data.eval_tokens": cfg.data.eval_tokens}
    return {f"{key} contents": content_digest(path) for key, path in paths.items()
            if isinstance(path, str) and os.path.exists(path)}


def job_description(cfg: JobConfig, model: ModelSpec, workers_per_node: int) -> dict[str, object]:
    """What every node of the run must agree on (flat dotted keys, JSON values), with its
    worker count: every plan lays the same number of workers on each node, so a node started
    with another --nproc-per-node is refused, not planned as if it had the others'."""
    fingerprint = model_fingerprint(model, DTYPES[cfg.train.param_dtype])
    flat: dict[str, object] = {"model.fingerprint": f"{model.name}:{fingerprint}",
                               "fault_tolerance": cfg.fault_tolerance, "nproc_per_node": workers_per_node}
    for name in ("train", "data", "planner", "checkpoint", "eval"):
        flat.update(_flatten(name, plain(getattr(cfg, name))))
    for local in LOCAL_KEYS:
        del flat[local]
    flat.update(_contents(cfg))
    return flat


def measure(model: ModelSpec, cfg: JobConfig) -> ModelProfile:
    """The model's profile: the cached one if its key matches, else measured (and cached)."""
    profile, _ = load_or_profile(model, directory=cfg.planner.profile_dir, microbatch_size=cfg.train.microbatch_size,
                                 precision=cfg.train.precision, seed=cfg.train.seed,
                                 iterations=cfg.planner.profile_iterations, optimizer=cfg.train.optimizer,
                                 device=resolve_device(cfg.train.device))
    return profile


def templates(profile: ModelProfile, cfg: JobConfig, nodes: int, workers_per_node: int) -> TemplateSet:
    """The job's pipeline templates for `nodes` nodes of `workers_per_node` workers; a
    PlanningError says what does not fit (no template in memory, fault tolerance too high)."""
    return plan_templates(profile, make_cluster(cfg.planner, profile, workers_per_node), max_nodes=nodes,
                          fault_tolerance=cfg.fault_tolerance, total_microbatches=cfg.train.num_microbatches,
                          virtual_stages=cfg.train.stages_per_worker)


def plan_run(protocol: WorkerSide, who: WorkerIdentity, first_nodes: Sequence[int], model: ModelSpec,
             cfg: JobConfig) -> TemplateSet:
    """The run's pipeline templates, planned for the first generation's node count from the
    profile the first node's first worker measures and publishes."""
    if who.node == min(first_nodes) and who.local_rank == 0:
        profile = measure(model, cfg)
        protocol.publish_profile(to_jsonable(profile))
    else:
        profile = from_jsonable(ModelProfile, protocol.profile(cfg.elastic.join_timeout_s))
    return templates(profile, cfg, len(first_nodes), who.local_world_size)
