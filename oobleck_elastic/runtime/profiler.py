"""The layer profiler: real forward and backward times and memory of each layer, cached.

For each layer, on the local device, with the job's microbatch size and dtype:
  * forward_ms / backward_ms: median of `iterations` timed runs after one warm-up; backward is
    a real `torch.autograd.backward` of the layer's output (the loss, for the last layer);
  * param_bytes, grad_bytes: the layer's trainable parameters and their gradients;
  * optimizer_bytes: the state the configured optimizer holds after one real step;
  * activation_bytes: tensors autograd saves for backward (counted once per storage);
  * output_bytes: the layer's output, what crosses a stage boundary.

The profile file (format in `planning.profile`) lives in `planner.profile_dir`, named by a hash
of every field of its key: the model's signature (its name and fingerprint: architecture
description, every layer's parameter and buffer shapes and dtypes; runtime.model.model_fingerprint)
with the optimizer, microbatch size, dtype, device and torch version. A cached file is used only if its recorded key matches; anything else is
profiled again, so a stale cache is never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable

import psutil
import torch

from oobleck_elastic.config import OptimizerConfig
from oobleck_elastic.planning.profile import PROFILE_FORMAT, LayerProfile, ModelProfile
from oobleck_elastic.runtime.model import DTYPES, ModelSpec, materialize_layer, model_fingerprint
from oobleck_elastic.runtime.supported import optimizer_class

__all__ = ["profile_model", "load_or_profile", "profile_path", "device_memory_bytes"]

logger = logging.getLogger(__name__)


def device_memory_bytes(device: torch.device) -> int:
    """Memory of one device: a GPU's own memory, or the host's RAM for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(psutil.virtual_memory().total)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device, iterations: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(iterations):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _saved_bytes(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _profile_layer(spec: ModelSpec, index: int, x: torch.Tensor, target: torch.Tensor, *,
                   seed: int, dtype: torch.dtype, device: torch.device, iterations: int,
                   optimizer: OptimizerConfig) -> tuple[LayerProfile, torch.Tensor]:
    layer = materialize_layer(spec, index, seed=seed, dtype=dtype, device=device)
    last = index == spec.num_layers - 1
    params = [p for p in layer.parameters() if p.requires_grad]

    def forward() -> torch.Tensor:
        inp = x.detach().requires_grad_(x.is_floating_point())
        out = layer(inp)
        return spec.loss(out, target) if last else out

    with torch.no_grad():
        next_input = layer(x)
    out, saved = _saved_bytes(forward)
    grad = None if last else torch.randn_like(out)
    forward_ms = _timed(lambda: forward(), device, iterations)

    def backward() -> None:
        result = forward()
        result.backward(grad)

    # Backward time = (forward + backward) - forward, both measured on fresh graphs.
    both_ms = _timed(backward, device, iterations)
    opt = optimizer_class(optimizer)(params, **dict(optimizer.kwargs)) if params else None
    if opt is not None:
        opt.step()
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    else:
        state = []
    profile = LayerProfile(
        name=spec.layers[index].name, forward_ms=forward_ms, backward_ms=max(both_ms - forward_ms, 1e-6),
        param_bytes=_nbytes(params), grad_bytes=_nbytes(params), optimizer_bytes=_nbytes(state),
        activation_bytes=saved, output_bytes=_nbytes([out]))
    return profile, next_input


def profile_model(spec: ModelSpec, *, microbatch_size: int, dtype: str, seed: int = 0,
                  iterations: int = 5, optimizer: OptimizerConfig | None = None,
                  device: torch.device | str = "cpu") -> ModelProfile:
    """Measures every layer of `spec` on `device` (see module docstring)."""
    optimizer = optimizer or OptimizerConfig()
    profile = _measure(spec, microbatch_size=microbatch_size, dtype=dtype, seed=seed, iterations=iterations,
                       optimizer=optimizer, device=device)
    return dataclasses.replace(profile, signature=_signature(spec, optimizer, dtype))


def _measure(spec: ModelSpec, *, microbatch_size: int, dtype: str, seed: int, iterations: int,
             optimizer: OptimizerConfig, device: torch.device | str) -> ModelProfile:
    """The measurements, with an empty signature (the callers set it)."""
    device = torch.device(device)
    torch_dtype = DTYPES[dtype]
    x, target = spec.sample_batch(microbatch_size)
    x = x.to(device=device, dtype=torch_dtype if x.is_floating_point() else x.dtype)
    target = target.to(device)
    layers = []
    for i in range(spec.num_layers):
        layer, x = _profile_layer(spec, i, x, target, seed=seed, dtype=torch_dtype, device=device,
                                  iterations=iterations, optimizer=optimizer)
        layers.append(layer)
    return ModelProfile(signature="", microbatch_size=microbatch_size,
                        dtype=dtype, device=_device_name(device), torch_version=torch.__version__,
                        device_memory_bytes=device_memory_bytes(device), layers=tuple(layers))


def _signature(spec: ModelSpec, optimizer: OptimizerConfig, dtype: str) -> str:
    return f"{spec.name}:{model_fingerprint(spec, DTYPES[dtype])}|optimizer={optimizer.name}"


def profile_path(directory: str, spec: ModelSpec, *, microbatch_size: int, dtype: str,
                 optimizer: OptimizerConfig, device: torch.device | str = "cpu") -> str:
    return _path(directory, spec, _key(spec, microbatch_size, dtype, optimizer, torch.device(device)))


def _path(directory: str, spec: ModelSpec, key: dict[str, object]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = spec.name.replace("/", "_").replace(".", "_") or "model"
    return os.path.join(directory, f"{name}-{digest}.json")


def _key(spec: ModelSpec, microbatch_size: int, dtype: str, optimizer: OptimizerConfig,
         device: torch.device) -> dict[str, object]:
    return {"format": PROFILE_FORMAT, "signature": _signature(spec, optimizer, dtype),
            "microbatch_size": microbatch_size, "dtype": dtype, "device": _device_name(device),
            "torch_version": torch.__version__}


def load_or_profile(spec: ModelSpec, *, directory: str, microbatch_size: int, dtype: str, seed: int = 0,
                    iterations: int = 5, optimizer: OptimizerConfig | None = None,
                    device: torch.device | str = "cpu") -> tuple[ModelProfile, bool]:
    """The cached profile if its key matches exactly, else a fresh one (saved). Returns
    (profile, came_from_cache)."""
    optimizer = optimizer or OptimizerConfig()
    device = torch.device(device)
    expected = _key(spec, microbatch_size, dtype, optimizer, device)  # the fingerprint, built once
    path = _path(directory, spec, expected)
    if os.path.exists(path):
        try:
            cached = ModelProfile.load(path)
        except Exception as exc:  # a damaged cache is re-measured, never trusted
            logger.warning("ignoring unreadable profile cache %s: %s", path, exc)
        else:
            if cached.key() == expected and cached.num_layers == spec.num_layers:
                return cached, True
            logger.info("profile cache %s is stale (key changed); profiling again", path)
    profile = dataclasses.replace(_measure(spec, microbatch_size=microbatch_size, dtype=dtype, seed=seed,
                                           iterations=iterations, optimizer=optimizer, device=device),
                                  signature=expected["signature"])
    profile.save(path)
    return profile, False
