"""Profile data: what the planner knows about each layer (time and memory per microbatch).

A profile is measured once per (model signature, microbatch size, dtype, device, torch
version) by `oobleck_elastic.runtime.profiler` and cached as a JSON *profile file*:

    {"format": 2, "signature": "...", "microbatch_size": 4, "dtype": "float32",
     "device": "cpu", "torch_version": "2.13.0+cpu", "device_memory_bytes": 25000000000,
     "layers": [{"name": "embed", "forward_ms": 0.8, "backward_ms": 1.7,
                 "param_bytes": ..., "grad_bytes": ..., "optimizer_bytes": ...,
                 "activation_bytes": ..., "output_bytes": ..., "optimizer_ms": 0.3,
                 "compute_copy_bytes": 0}, ...]}

`dtype` is the dtype of a single-dtype precision (float32, bfloat16, float64) or "bf16-mixed".
Times are milliseconds per microbatch (optimizer_ms: per step); bytes are per worker holding the layer. activation_bytes
is what the layer keeps alive for its backward per microbatch; output_bytes is the tensor it
hands to the next layer (what crosses a stage boundary). `synthetic_gpt` builds a
transformer-shaped profile without torch, for dry runs and planner benchmarks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from oobleck_elastic.errors import ProfileError
from oobleck_elastic.planning.values import from_jsonable, to_jsonable

__all__ = ["LayerProfile", "ModelProfile", "synthetic_gpt", "PROFILE_FORMAT", "GPT3_SIZES"]

PROFILE_FORMAT = 4
"""2: layers carry optimizer_ms and compute_copy_bytes (format-1 caches are profiled again).
3: forward_ms and backward_ms are timed in context (runtime/profiler.py Note: [layers timed in
context]). 4: so is optimizer_ms. The fields are format 2's, so a format-2 or -3 file still
loads (`--profile FILE`), but a cached one is stale and profiled again."""
READABLE_FORMATS = (2, 3, 4)

GPT3_SIZES = {"125M": (12, 768), "350M": (24, 1024), "760M": (24, 1536), "1.3B": (24, 2048),
              "2.7B": (32, 2560), "6.7B": (32, 4096), "13B": (40, 5140), "175B": (96, 12288)}
"""(transformer blocks, hidden size) of the GPT-3 family (Brown et al., 2020, Table 2.1), for
`synthetic_gpt(blocks + 2, hidden=...)`."""


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Measured cost of one layer for one microbatch."""

    name: str
    forward_ms: float
    backward_ms: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    output_bytes: int
    optimizer_ms: float = 0.0
    """The optimizer's step on this layer, once per iteration (not per microbatch); under
    bf16-mixed with the refresh of the layer's bf16 copy."""
    compute_copy_bytes: int = 0
    """The low-precision copy of the parameters the stage computes with (bf16-mixed), held
    beside the master parameters; 0 when the stage computes on the master itself."""

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def static_bytes(self) -> int:
        """Memory held whatever the number of microbatches in flight (both copies of the
        parameters under bf16-mixed)."""
        return self.param_bytes + self.compute_copy_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def state_bytes(self) -> int:
        """What moves when a replica of this layer is rebuilt: parameters and optimizer state."""
        return self.param_bytes + self.optimizer_bytes


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A model's layers as measured on one device, keyed so a stale cache is never used."""

    signature: str
    microbatch_size: int
    dtype: str
    device: str
    torch_version: str
    device_memory_bytes: int | None
    layers: tuple[LayerProfile, ...]
    format: int = PROFILE_FORMAT

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError("a profile needs at least one layer")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def key(self) -> dict[str, object]:
        """The fields that must all match for a cached profile to be reused."""
        return {"format": self.format, "signature": self.signature,
                "microbatch_size": self.microbatch_size, "dtype": self.dtype,
                "device": self.device, "torch_version": self.torch_version}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the profile file atomically (write then rename)."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(to_jsonable(self), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelProfile:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError as exc:
            raise ProfileError(f"profile file {os.fspath(path)!r} does not exist") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileError(f"profile file {os.fspath(path)!r} is unreadable: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") not in READABLE_FORMATS:
            raise ProfileError(
                f"profile file {os.fspath(path)!r} is not a format-{PROFILE_FORMAT} profile; "
                "delete it and profile again")
        try:
            return from_jsonable(cls, data)
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"profile file {os.fspath(path)!r} is missing a field: {exc}") from exc


def synthetic_gpt(num_layers: int, *, hidden: int = 4096, seq_len: int = 2048,
                  microbatch_size: int = 1, vocab: int = 50257,
                  tflops: float = 100.0, bytes_per_param: int = 2) -> ModelProfile:
    """A GPT-like profile: embedding, num_layers - 2 transformer blocks, head.

    Times come from FLOP counts at `tflops` sustained; backward is twice forward; AdamW keeps
    two float32 moments plus a float32 master copy (12 bytes a parameter).
    """
    if num_layers < 3:
        raise ProfileError("a synthetic GPT needs at least 3 layers (embedding, block, head)")
    tokens = microbatch_size * seq_len
    act = tokens * hidden * bytes_per_param

    def layer(name: str, params: int, flops: float, saved: int, out: int) -> LayerProfile:
        fwd = flops / (tflops * 1e12) * 1e3
        return LayerProfile(name=name, forward_ms=fwd, backward_ms=2 * fwd,
                            param_bytes=params * bytes_per_param, grad_bytes=params * bytes_per_param,
                            optimizer_bytes=params * 12, activation_bytes=saved, output_bytes=out)

    block_params = 12 * hidden * hidden
    block_flops = 2 * tokens * block_params + 4 * tokens * seq_len * hidden
    layers = [layer("embed", vocab * hidden, 2 * tokens * hidden, act, act)]
    layers += [layer(f"block{i}", block_params, block_flops, 16 * act, act)
               for i in range(num_layers - 2)]
    layers.append(layer("head", vocab * hidden, 2 * tokens * hidden * vocab,
                        2 * tokens * vocab * bytes_per_param, 4))
    return ModelProfile(signature=f"synthetic-gpt-{num_layers}x{hidden}", microbatch_size=microbatch_size,
                        dtype="bfloat16", device="synthetic", torch_version="n/a",
                        device_memory_bytes=80 * 2**30, layers=tuple(layers))
