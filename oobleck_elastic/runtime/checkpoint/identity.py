"""What a checkpoint belongs to: the job (`job_key`, what must match to load it, and its digest)
and the run that writes it (`CheckpointId`); a checkpoint that cannot be read is
`CheckpointUnreadable`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oobleck_elastic.errors import CheckpointDamaged
from oobleck_elastic.runtime.model import DTYPES, ModelSpec, model_fingerprint, state_shapes

__all__ = ["CheckpointUnreadable", "plain", "job_key", "job_digest", "CheckpointId", "checkpoint_id"]


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
