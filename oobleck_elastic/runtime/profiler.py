"""The layer profiler: real forward and backward times and memory of each layer, cached.

For each layer, on the local device, with the job's microbatch size and precision:
  * forward_ms / backward_ms: median of `iterations` timed passes after one warm-up, each
    layer timed in its place in a chain of consecutive layers run as a stage runs them (Note:
    [layers timed in context]); backward is a real `torch.autograd.backward` of the layer's
    output (the loss, for the last layer);
  * optimizer_ms: the configured optimizer's step on the layer (under bf16-mixed with the
    refresh of the layer's bf16 copy from its float32 master), timed in the same chain, right
    after its backward pass, layer after layer as a worker applies a step (timed alone, over
    and over, it came to 0.63-0.75 of what the step costs in a worker here);
  * param_bytes, grad_bytes: the layer's trainable (master) parameters and their gradients;
  * compute_copy_bytes: the bf16 copy the stage computes with under bf16-mixed (else 0);
  * optimizer_bytes: the state the configured optimizer holds after one real step;
  * activation_bytes: tensors autograd saves for backward (counted once per storage; on CUDA
    at least the allocator's peak growth during the forward);
  * output_bytes: the layer's output, what crosses a stage boundary.

The layer runs exactly as a worker runs it (runtime.layers.LayerState: master, compute copy,
gradient hooks, optimizer). On CUDA times come from CUDA events, on the CPU from the wall clock.

Note: [layers timed in context]
    A layer timed alone, again and again, keeps its weights and activations in the caches;
    in a stage it runs after its neighbours, which have pushed them out. On this machine's
    CPU the sum of the layers timed alone came to ~0.92 of a forward and backward of the
    whole model, and the cost model under-predicted every layout by at least that much. So
    the layers are timed in windows of consecutive layers, back to back, one forward pass
    through the window and then one backward pass in reverse, with the activation detached
    at each layer's input (as at a stage boundary) so each layer's forward and backward are
    timed on their own. A window holds as many layers as fit a quarter of the device's
    memory (all of them, on a CPU or a GPU that holds the model), so a model larger than one
    device is still profiled, window by window; each window starts from the previous one's
    output.

The profile file (format in `planning.profile`) lives in `planner.profile_dir`, named by a hash
of every field of its key: the model's signature (its name and fingerprint: architecture
description, every layer's parameter and buffer shapes and dtypes; runtime.model.model_fingerprint)
with the optimizer, microbatch size, precision, device and torch version. A cached file is used
only if its recorded key matches; anything else is profiled again, so a stale cache is never
used.
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
from typing import TypeVar, cast

import psutil
import torch

from oobleck_elastic.config import OptimizerConfig, TrainConfig
from oobleck_elastic.config.schema import PRECISIONS, Precision
from oobleck_elastic.planning.profile import PROFILE_FORMAT, LayerProfile, ModelProfile
from oobleck_elastic.runtime.layers import LayerState
from oobleck_elastic.runtime.model import DTYPES, ModelSpec, materialize_layer, model_fingerprint

__all__ = ["profile_model", "load_or_profile", "profile_path", "device_memory_bytes", "resolve_precision"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def device_memory_bytes(device: torch.device) -> int:
    """Memory of one device: a GPU's own memory, or the host's RAM for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(psutil.virtual_memory().total)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"


def _peak_growth(run: Callable[[], T], device: torch.device) -> tuple[T, int]:
    """run()'s result and, on CUDA, how far the allocator's peak rose above what was allocated
    before (0 on the CPU, which has no such counter)."""
    if device.type != "cuda":
        return run(), 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = run()
    torch.cuda.synchronize(device)
    return out, max(0, torch.cuda.max_memory_allocated(device) - before)


def resolve_precision(precision: str | None = None, dtype: str | None = None) -> Precision:
    """train.precision from either spelling the profiler takes: a precision (fp32, bf16-mixed,
    bf16, fp64) or a former dtype name (float32, bfloat16, float64)."""
    value = precision or dtype or "fp32"
    value = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64"}.get(value, value)
    if value not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)} (or float32, bfloat16, float64), "
                         f"got {precision or dtype!r}")
    return cast(Precision, value)  # one of PRECISIONS' keys, which are the Precision literals


def _profile_name(precision: str) -> str:
    """The profile's `dtype` field: the dtype name for a single-dtype precision (as profiles
    recorded before train.precision), the precision for bf16-mixed."""
    master, compute = PRECISIONS[precision]
    return master if master == compute else precision


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
                   seed: int, train: TrainConfig, device: torch.device) -> tuple[LayerProfile, torch.Tensor]:
    master = materialize_layer(spec, index, seed=seed, dtype=DTYPES[train.param_dtype], device=device)
    state = LayerState(master, train)  # master, compute copy and optimizer, as a worker holds them
    layer = state.compute
    last = index == spec.num_layers - 1

    def forward() -> torch.Tensor:
        inp = x.detach().requires_grad_(x.is_floating_point())
        out = layer(inp)
        if last and out.is_floating_point():
            out = out.to(master_dtype)  # the loss in the master's dtype, as the trainer computes it
        return spec.loss(out, target) if last else out

    master_dtype = DTYPES[train.param_dtype]
    with torch.no_grad():
        next_input = layer(x)
    (out, saved), peak = _peak_growth(lambda: _saved_bytes(forward), device)
    forward().backward(None if last else torch.randn_like(out))  # every master gradient exists
    if state.optimizer is not None:  # one real step creates the state measured below
        state.grads()
        state.optimizer.step()
    opt_state = [v for s in state.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v)] if state.optimizer else []
    copy_bytes = _nbytes([p for p in layer.parameters() if p.requires_grad]) if layer is not master else 0
    profile = LayerProfile(
        name=spec.layers[index].name, forward_ms=0.0, backward_ms=0.0,  # timed in context (below)
        param_bytes=_nbytes(state.params), grad_bytes=_nbytes(state.params), optimizer_bytes=_nbytes(opt_state),
        activation_bytes=max(saved, peak), output_bytes=_nbytes([out]), optimizer_ms=0.0,  # timed in context
        compute_copy_bytes=copy_bytes)
    return profile, next_input


def _windows(layers: list[LayerProfile], budget: int) -> list[range]:
    """Consecutive layers whose parameters, gradients, optimizer state, compute copies and
    activations fit `budget` together, at least one layer each (Note: [layers timed in
    context])."""
    windows, start, used = [], 0, 0
    for i, layer in enumerate(layers):
        size = (2 * layer.param_bytes + layer.optimizer_bytes + layer.compute_copy_bytes + layer.activation_bytes
                + layer.output_bytes)  # the optimizer steps in the window too
        if i > start and used + size > budget:
            windows.append(range(start, i))
            start, used = i, 0
        used += size
    windows.append(range(start, len(layers)))
    return windows


class _Marks:
    """Time marks on `device`: the wall clock on the CPU, CUDA events (read after one
    synchronize) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        """Milliseconds between consecutive marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def _time_in_context(spec: ModelSpec, windows: list[range], x: torch.Tensor, target: torch.Tensor, *, seed: int,
                     train: TrainConfig, device: torch.device,
                     iterations: int) -> list[tuple[float, float, float]]:
    """(forward_ms, backward_ms, optimizer_ms) of every layer, each window's layers run back to
    back as a stage runs them (Note: [layers timed in context]): one forward pass, one backward
    pass in reverse, then each layer's optimizer step (with the refresh of its compute copy) in
    order, as a worker applies a step; medians of `iterations` passes after one warm-up."""
    master_dtype = DTYPES[train.param_dtype]
    last_layer = spec.num_layers - 1
    out: list[tuple[float, float, float]] = []
    for window in windows:
        states = [LayerState(materialize_layer(spec, i, seed=seed, dtype=master_dtype, device=device), train)
                  for i in window]
        grad = None
        samples: list[list[float]] = []
        for n in range(iterations + 1):
            forward, backward, optimizer = _Marks(device), _Marks(device), _Marks(device)
            inputs, outputs = [], []
            h = x
            forward.mark()
            for i, state in zip(window, states):
                inp = h.detach().requires_grad_(h.is_floating_point())
                h = state.compute(inp)
                if i == last_layer:
                    h = spec.loss(h.to(master_dtype) if h.is_floating_point() else h, target)
                inputs.append(inp)
                outputs.append(h)
                forward.mark()
            if grad is None and window[-1] != last_layer:
                grad = torch.randn_like(h)
            upstream = grad
            backward.mark()
            for inp, output in zip(reversed(inputs), reversed(outputs)):
                torch.autograd.backward(output, upstream)
                upstream = inp.grad
                backward.mark()
            optimizer.mark()
            for state in states:
                if state.optimizer is not None:
                    state.grads()  # a parameter the pass left without a gradient gets zeros, as in apply()
                    state.optimizer.step()
                    state.refresh_compute()
                state.zero_grad()
                optimizer.mark()
            if n:  # the first pass warms up
                samples.append(forward.spans_ms() + backward.spans_ms()[::-1] + optimizer.spans_ms())
        x = h.detach()
        k = len(window)
        medians = [statistics.median(column) for column in zip(*samples)]
        out.extend((medians[j], max(medians[k + j], 1e-6),
                    medians[2 * k + j] if states[j].optimizer is not None else 0.0) for j in range(k))
        del states
    return out


def profile_model(spec: ModelSpec, *, microbatch_size: int, precision: str | None = None, seed: int = 0,
                  iterations: int = 5, optimizer: OptimizerConfig | None = None,
                  device: torch.device | str = "cpu", dtype: str | None = None) -> ModelProfile:
    """Measures every layer of `spec` on `device` (see module docstring). `dtype`: the former
    name of `precision` (float32, bfloat16, float64)."""
    optimizer = optimizer or OptimizerConfig()
    precision = resolve_precision(precision, dtype)
    profile = _measure(spec, microbatch_size=microbatch_size, precision=precision, seed=seed,
                       iterations=iterations, optimizer=optimizer, device=device)
    return dataclasses.replace(profile, signature=_signature(spec, optimizer, precision))


def _measure(spec: ModelSpec, *, microbatch_size: int, precision: Precision, seed: int, iterations: int,
             optimizer: OptimizerConfig, device: torch.device | str) -> ModelProfile:
    """The measurements, with an empty signature (the callers set it)."""
    device = torch.device(device)
    train = TrainConfig(precision=precision, optimizer=optimizer, seed=seed)
    compute_dtype = DTYPES[train.compute_dtype]
    x, target = spec.sample_batch(microbatch_size)
    x = x.to(device=device, dtype=compute_dtype if x.is_floating_point() else x.dtype)
    target = target.to(device)
    first_input, layers = x, []
    for i in range(spec.num_layers):
        layer, x = _profile_layer(spec, i, x, target, seed=seed, train=train, device=device)
        layers.append(layer)
    times = _time_in_context(spec, _windows(layers, device_memory_bytes(device) // 4), first_input, target,
                             seed=seed, train=train, device=device, iterations=iterations)
    if device.type == "cuda":  # what the layers used goes back to the GPU, for the workers the plan counts on
        torch.cuda.empty_cache()
    layers = [dataclasses.replace(layer, forward_ms=f, backward_ms=b, optimizer_ms=o)
              for layer, (f, b, o) in zip(layers, times)]
    return ModelProfile(signature="", microbatch_size=microbatch_size,
                        dtype=_profile_name(precision), device=_device_name(device), torch_version=torch.__version__,
                        device_memory_bytes=device_memory_bytes(device), layers=tuple(layers))


def _signature(spec: ModelSpec, optimizer: OptimizerConfig, precision: str) -> str:
    return f"{spec.name}:{model_fingerprint(spec, DTYPES[PRECISIONS[precision][0]])}|optimizer={optimizer.name}"


def profile_path(directory: str, spec: ModelSpec, *, microbatch_size: int, precision: str | None = None,
                 optimizer: OptimizerConfig, device: torch.device | str = "cpu", dtype: str | None = None) -> str:
    return _path(directory, spec, _key(spec, microbatch_size, resolve_precision(precision, dtype), optimizer,
                                       torch.device(device)))


def _path(directory: str, spec: ModelSpec, key: dict[str, object]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = spec.name.replace("/", "_").replace(".", "_") or "model"
    return os.path.join(directory, f"{name}-{digest}.json")


def _key(spec: ModelSpec, microbatch_size: int, precision: str, optimizer: OptimizerConfig,
         device: torch.device) -> dict[str, object]:
    return {"format": PROFILE_FORMAT, "signature": _signature(spec, optimizer, precision),
            "microbatch_size": microbatch_size, "dtype": _profile_name(precision), "device": _device_name(device),
            "torch_version": torch.__version__}


def load_or_profile(spec: ModelSpec, *, directory: str, microbatch_size: int, precision: str | None = None,
                    seed: int = 0, iterations: int = 5, optimizer: OptimizerConfig | None = None,
                    device: torch.device | str = "cpu", dtype: str | None = None) -> tuple[ModelProfile, bool]:
    """The cached profile if its key matches exactly, else a fresh one (saved). Returns
    (profile, came_from_cache). `dtype`: the former name of `precision`."""
    optimizer = optimizer or OptimizerConfig()
    precision = resolve_precision(precision, dtype)
    device = torch.device(device)
    expected = _key(spec, microbatch_size, precision, optimizer, device)  # the fingerprint, built once
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
    profile = dataclasses.replace(_measure(spec, microbatch_size=microbatch_size, precision=precision, seed=seed,
                                           iterations=iterations, optimizer=optimizer, device=device),
                                  signature=str(expected["signature"]))
    profile.save(path)
    return profile, False
