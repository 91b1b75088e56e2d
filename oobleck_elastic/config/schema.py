"""The job configuration: one frozen, typed dataclass per section, validated once.

YAML maps onto these classes key for key (see `load_config`); every field has a default, so an
empty file is a valid job. Messages name the dotted field path and what is accepted.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from oobleck_elastic.errors import ConfigError

__all__ = [
    "OptimizerConfig",
    "LRScheduleConfig",
    "TrainConfig",
    "PlannerConfig",
    "CheckpointConfig",
    "DataConfig",
    "MonitoringConfig",
    "ElasticConfig",
    "EvalConfig",
    "JobConfig",
    "parse_bytes",
    "PRECISIONS",
]

Dtype = Literal["float32", "bfloat16", "float64"]
Precision = Literal["fp32", "bf16-mixed", "bf16", "fp64"]
Device = Literal["auto", "cpu", "cuda"]

PRECISIONS: dict[str, tuple[str, str]] = {
    "fp32": ("float32", "float32"),
    "bf16-mixed": ("float32", "bfloat16"),
    "bf16": ("bfloat16", "bfloat16"),
    "fp64": ("float64", "float64"),
}
"""train.precision -> (dtype of the master parameters, gradients and optimizer state; dtype of
forward and backward compute and of the activations between stages)."""

_DTYPE_ALIAS = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64"}
ScheduleName = Literal["1F1B", "GPipe", "Interleaved1F1B"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str, path: str) -> int:
    """'16GiB', '512 MB' or a plain integer of bytes -> bytes."""
    if isinstance(value, int):
        amount = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{path} must be a byte count such as 17179869184, '16GiB' or '512MB', got {value!r}"
            )
        amount = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if amount <= 0:
        raise ConfigError(f"{path} must be positive, got {value!r}")
    return amount


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Any `torch.optim` optimizer: its class name and keyword arguments (written inline).

    The name and the argument names are checked against torch.optim by the runtime
    (runtime/supported.py), which entry points call before any worker starts: this layer does
    not import torch."""

    __config_rest__ = "kwargs"

    name: str = "AdamW"
    """Class name in torch.optim, e.g. AdamW, SGD, Adam."""
    kwargs: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({"lr": 1e-3}))
    """Keyword arguments of the optimizer's constructor (lr, weight_decay, betas, ...)."""

    def __post_init__(self) -> None:
        lists = {key: tuple(value) for key, value in self.kwargs.items() if isinstance(value, (list, tuple))}
        if lists:  # YAML lists (betas) become tuples: a frozen config holds no mutable list
            object.__setattr__(self, "kwargs", types.MappingProxyType({**self.kwargs, **lists}))
        lr = self.kwargs.get("lr")
        if lr is not None:
            _check(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0,
                   f"train.optimizer.lr must be a positive number, got {lr!r}")


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """Learning-rate schedule applied on top of the optimizer's lr."""

    kind: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up: constant, cosine or linear down to min_ratio * lr at the last step."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0."""
    min_ratio: float = 0.0
    """Final lr as a fraction of the peak lr (cosine and linear)."""

    def __post_init__(self) -> None:
        _check(self.warmup_steps >= 0,
               f"train.lr_schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(0.0 <= self.min_ratio <= 1.0,
               f"train.lr_schedule.min_ratio must be in [0, 1], got {self.min_ratio}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What one optimizer step is and how many there are."""

    global_batch_size: int = 32
    """Samples per optimizer step (B); constant for the whole run, whatever the membership."""
    microbatch_size: int = 4
    """Samples per microbatch (b); B must be a multiple of b."""
    steps: int = 20
    """Optimizer steps to run."""
    seed: int = 0
    """Seeds layer initialisation (layer i from (seed, i)) and the data permutation."""
    precision: Precision | None = None
    """fp32 (default), fp64, bf16 (everything in bfloat16: parameters, gradients, optimizer
    state), or bf16-mixed: forward and backward in bfloat16 on a bfloat16 copy of each layer,
    while the master parameters, the gradients summed across pipelines and the optimizer
    state stay float32 (what checkpoints and layer transfers carry)."""
    dtype: str | None = None
    """Former name of `precision`, still accepted: float32 = fp32, bfloat16 = bf16 (pure),
    float64 = fp64. Read `precision` (or `param_dtype`) instead; this is None once loaded."""
    device: Device = "auto"
    """auto: cuda:LOCAL_RANK when CUDA is available, else cpu; cpu; or cuda (an error when
    CUDA is not available)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """torch.optim optimizer: `name` plus its keyword arguments."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """Learning-rate schedule."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm (each layer counted once) to this value; null: no clipping."""
    schedule: ScheduleName = "1F1B"
    """Pipeline schedule of torch.distributed.pipelining."""
    virtual_stages: int = 2
    """Interleaved1F1B only: stages per worker (the model is split into this many times the
    pipeline's worker count; worker w runs stages w, w + S, ...)."""
    no_weight_decay: tuple[str, ...] = ()
    """Parameter-name patterns (fnmatch, on the model's own names, e.g. '*.bias', '*norm*',
    '*wte*') that get weight_decay 0; every other parameter gets the optimizer's."""

    def __post_init__(self) -> None:
        if self.dtype is not None:  # the alias: resolved once, so the loaded config has one spelling
            _check(self.dtype in _DTYPE_ALIAS,
                   f"train.dtype must be one of {', '.join(map(repr, _DTYPE_ALIAS))}, got {self.dtype!r}; "
                   "train.dtype is the former name of train.precision: prefer train.precision "
                   f"({', '.join(PRECISIONS)})")
            alias = _DTYPE_ALIAS[self.dtype]
            _check(self.precision in (None, alias),
                   f"train.dtype ({self.dtype}) is the former name of train.precision and means "
                   f"precision {alias}, but train.precision is {self.precision}; set only train.precision")
            object.__setattr__(self, "precision", alias)
            object.__setattr__(self, "dtype", None)
        if self.precision is None:
            object.__setattr__(self, "precision", "fp32")
        for name in ("global_batch_size", "microbatch_size", "steps"):
            value = getattr(self, name)
            _check(value >= 1, f"train.{name} must be >= 1, got {value}")
        _check(self.seed >= 0, f"train.seed must be >= 0, got {self.seed}")
        if self.global_batch_size % self.microbatch_size:
            lower = self.global_batch_size // self.microbatch_size * self.microbatch_size
            upper = lower + self.microbatch_size
            near = f"{upper}" if lower == 0 else f"{lower} or {upper}"
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"train.microbatch_size ({self.microbatch_size}); nearest valid: {near}"
            )
        _check(self.virtual_stages >= 1, f"train.virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.schedule == "Interleaved1F1B":
            _check(self.virtual_stages >= 2,
                   f"train.schedule Interleaved1F1B needs train.virtual_stages >= 2, got "
                   f"{self.virtual_stages}; use schedule 1F1B for one stage per worker")
        if self.grad_clip_norm is not None:
            _check(self.grad_clip_norm > 0,
                   f"train.grad_clip_norm must be > 0 or null, got {self.grad_clip_norm}")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size

    @property
    def param_dtype(self) -> str:
        """dtype name of the master parameters, gradients and optimizer state."""
        assert self.precision is not None, "set in __post_init__"
        return PRECISIONS[self.precision][0]

    @property
    def compute_dtype(self) -> str:
        """dtype name of forward/backward compute and of the activations between stages."""
        assert self.precision is not None, "set in __post_init__"
        return PRECISIONS[self.precision][1]

    @property
    def mixed(self) -> bool:
        """Whether compute runs on a lower-precision copy of the master parameters."""
        return self.param_dtype != self.compute_dtype

    @property
    def stages_per_worker(self) -> int:
        """Pipeline stages each worker runs: virtual_stages when interleaved, else 1."""
        return self.virtual_stages if self.schedule == "Interleaved1F1B" else 1


TokenDtype = Literal["uint16", "uint32"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training data: a flat binary file of token ids (`python -m oobleck_elastic.data.prepare`
    writes one), or none when the training script brings its own dataset."""

    tokens: str | None = None
    """Path of the token file; sample i is tokens[i*T:(i+1)*T] -> tokens[i*T+1:(i+1)*T+1]."""
    token_dtype: TokenDtype = "uint16"
    """Element type of the token file: uint16 (vocabularies up to 65,536) or uint32."""
    seq_len: int = 128
    """T: tokens per sample."""
    shuffle: bool = True
    """Visit samples in a permutation seeded by train.seed (each epoch its own); false: global
    position j of the run is sample j mod N."""
    eval_tokens: str | None = None
    """Token file of the evaluation data (same format, dtype and seq_len as `tokens`)."""

    def __post_init__(self) -> None:
        _check(self.seq_len >= 1, f"data.seq_len must be >= 1, got {self.seq_len}")


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Inputs of the pipeline-template planner besides the profile."""

    memory_per_worker: int | str | None = None
    """Per-worker memory budget ('16GiB', '512MB' or bytes); null: the device's own memory."""
    intra_node_bandwidth: float = 50.0
    """GB/s between workers of one node (stage-to-stage activation transfer)."""
    inter_node_bandwidth: float = 12.5
    """GB/s between nodes."""
    link_latency_us: float = 20.0
    """Fixed cost of one stage-to-stage message, microseconds."""
    wide: bool = False
    """Plan stages spanning several workers of a node (dry runs only; not executable)."""
    profile_dir: str = ".oobleck/profiles"
    """Where profile files are cached."""
    profile_iterations: int = 5
    """Timed repetitions per layer when profiling (after one warm-up)."""

    def __post_init__(self) -> None:
        if self.memory_per_worker is not None:
            object.__setattr__(self, "memory_per_worker",
                               parse_bytes(self.memory_per_worker, "planner.memory_per_worker"))
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            _check(getattr(self, name) > 0, f"planner.{name} must be > 0 GB/s, got {getattr(self, name)}")
        _check(self.link_latency_us >= 0,
               f"planner.link_latency_us must be >= 0, got {self.link_latency_us}")
        _check(self.profile_iterations >= 1,
               f"planner.profile_iterations must be >= 1, got {self.profile_iterations}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints: what a stopped job resumes from, and the fallback when more failures than
    replicas occur (runtime/checkpoint/manifest.py Note: [checkpoint manifest])."""

    dir: str = "checkpoints"
    """Directory of checkpoints, shared by every node (one file per layer; a step is published
    by one rename once complete)."""
    interval: int = 50
    """Steps between checkpoints; 0: only the final one (after the last step or a stop)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: a job started with checkpoints of the same job in `dir` continues from the newest
    (a checkpoint of another job is an error naming the difference); never: start afresh."""
    load_step: int | None = None
    """With resume: auto, the step to resume from instead of the newest."""
    keep: int | None = None
    """Keep only the newest this many checkpoints of the job (null: keep all)."""
    background: bool = True
    """Write checkpoints in a background thread (the step only copies its layers' state to host
    memory); false: the step waits until its checkpoint is on disk."""

    def __post_init__(self) -> None:
        _check(self.interval >= 0, f"checkpoint.interval must be >= 0 (0 disables), got {self.interval}")
        if self.load_step is not None:
            _check(self.load_step >= 0, f"checkpoint.load_step must be >= 0 or null, got {self.load_step}")
            _check(self.resume == "auto", "checkpoint.load_step picks the checkpoint to resume from; it needs "
                                          "checkpoint.resume=auto, got never")
        if self.keep is not None:
            _check(self.keep >= 1, f"checkpoint.keep must be >= 1 or null (keep all), got {self.keep}")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation: the loss on held-out data (data.eval_tokens, or the training script's eval
    dataset), forward only through the pipelines, averaged as training averages it."""

    interval: int = 0
    """Steps between evaluations (after steps interval, 2 x interval, ...); 0: none."""
    steps: int = 1
    """Batches of train.global_batch_size samples per evaluation: the first `steps` x B samples
    of the eval data, in order, the same at every evaluation."""

    def __post_init__(self) -> None:
        _check(self.interval >= 0, f"eval.interval must be >= 0 (0 disables), got {self.interval}")
        _check(self.steps >= 1, f"eval.steps must be >= 1, got {self.steps}")


@dataclass(frozen=True, kw_only=True)
class MonitoringConfig:
    """Where a run reports itself."""

    tensorboard_dir: str = "runs/tensorboard"
    """TensorBoard log directory."""
    metrics_path: str = "runs/metrics.jsonl"
    """JSONL metrics log, one record per step."""
    log_interval: int = 1
    """Steps between progress lines."""

    def __post_init__(self) -> None:
        _check(self.log_interval >= 1, f"monitoring.log_interval must be >= 1, got {self.log_interval}")


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Timeouts of the elastic layer, ordered so they never race: a collective times out before
    a lease expires, and a lease before the survivors give up agreeing."""

    heartbeat_interval_s: float = 0.2
    """Seconds between lease renewals."""
    collective_timeout_s: float = 10.0
    """Process-group timeout: a collective that waits longer raises."""
    lease_timeout_s: float = 15.0
    """A node whose lease is older than this is dead (catches hangs and partitions)."""
    agreement_timeout_s: float = 30.0
    """Longest wait for the survivors to agree on the next generation."""
    rollcall_window_s: float = 0.6
    """After an error, a member that has not checked in is dead once its lease has stood still
    this long (at least 3 heartbeats: a live agent's lease keeps moving)."""
    join_timeout_s: float = 300.0
    """How long a starting node waits to be admitted."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check(value > 0, f"elastic.{f.name} must be > 0 seconds, got {value}")
        _check(self.heartbeat_interval_s * 2 <= self.lease_timeout_s,
               f"elastic.heartbeat_interval_s ({self.heartbeat_interval_s}) must be at most half "
               f"of elastic.lease_timeout_s ({self.lease_timeout_s}) so one late beat is not a death")
        _check(self.collective_timeout_s < self.lease_timeout_s < self.agreement_timeout_s,
               "elastic timeouts must be ordered collective_timeout_s < lease_timeout_s < "
               f"agreement_timeout_s, got {self.collective_timeout_s} < {self.lease_timeout_s} < "
               f"{self.agreement_timeout_s}")
        _check(3 * self.heartbeat_interval_s <= self.rollcall_window_s * (1 + 1e-9)
               <= self.lease_timeout_s * (1 + 1e-9),
               f"elastic.rollcall_window_s ({self.rollcall_window_s}) must be at least 3 heartbeats "
               f"(3 x {self.heartbeat_interval_s}) so a live node is never taken for dead, and at most "
               f"elastic.lease_timeout_s ({self.lease_timeout_s})")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole job. `model` is free-form: the model's own code parses it (see examples/gpt)."""

    model: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))
    """Model options, parsed by the model factory with the same rules as this file."""
    train: TrainConfig = field(default_factory=TrainConfig)
    fault_tolerance: int = 1
    """f: any f simultaneous node failures are recovered in memory."""
    data: DataConfig = field(default_factory=DataConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def __post_init__(self) -> None:
        _check(self.fault_tolerance >= 0,
               f"fault_tolerance must be >= 0, got {self.fault_tolerance}")
