"""The model interface: an ordered list of layers, a mean loss, and the parameters layers share.

Note: [layer initialisation]
    Layer i is built by its factory inside a forked RNG seeded from (seed, i), so every worker
    that materialises layer i gets identical weights without a broadcast, whatever other layers
    it builds and in whatever order. Factories that load weights (a Hugging Face directory) or
    copy a given module are identical everywhere anyway; the seed then changes nothing.

Note: [parameter names]
    The keys of a layer module's state_dict are the model's own names (GPT-2's embedding layer
    holds `transformer.wte.weight`, layer 3 of an nn.Sequential holds `3.weight`). Merging every
    layer's state_dict gives the model's state_dict, so checkpoints and exports need no mapping,
    and `train.no_weight_decay` patterns match the names users know. A name appears in one layer
    only, except a tied parameter, whose copies each keep their own name (see below).

Note: [loss]
    `ModelSpec.loss(output, target)` is a mean, the convention of every library: over the
    target's counted elements, `loss_count(target)` (for integer targets those that are not
    -100, else every element). The runtime turns each microbatch's mean back into a sum
    (times its count) and divides by the count of the whole global batch, which the data gives
    before the step. The gradient is then that of the mean over the global batch, whatever the
    pipeline and microbatch split and however many counted tokens each microbatch holds.

Note: [tied parameters]
    A SharedParameter names the copies of one logical parameter in several layers (GPT-2's
    `transformer.wte.weight` in the embedding and `lm_head.weight` in the head). Each layer
    keeps its own copy, so a layer stays the one unit of placement, transfer, checkpoint and
    optimizer state. Before the optimizer step the runtime sums the gradients of every copy
    over every replica (one all-reduce over all their holders), so every copy gets the same
    gradient and the same update and all stay bit-identical. The first member is canonical: it
    alone counts in the gradient norm, and its name picks the weight-decay group of all copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["LayerSpec", "ModelSpec", "SharedParameter", "boundary_activations", "counted_elements", "layer_seed",
           "materialize_layer", "model_fingerprint", "state_shapes", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

IGNORE_INDEX = -100


def counted_elements(target: torch.Tensor) -> int:
    """Elements a mean loss averages over: integer targets not equal to -100, else all."""
    if target.is_floating_point():
        return target.numel()
    return int((target != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class LayerSpec:
    """One entry of the model's layer list: `factory()` builds its module, whose state_dict
    keys are the model's own names (Note: [parameter names])."""

    name: str
    factory: Callable[[], nn.Module]


@dataclass(frozen=True)
class SharedParameter:
    """Copies of one parameter in several layers: ((layer index, parameter name), ...), the
    first canonical (Note: [tied parameters])."""

    members: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if len(self.members) < 2 or len({layer for layer, _ in self.members}) != len(self.members):
            raise ValueError(f"a shared parameter needs copies in at least two different layers, got {self.members}")

    @property
    def canonical(self) -> tuple[int, str]:
        return self.members[0]


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner and runtime see it."""

    name: str
    """Short name for logs and profile files (e.g. 'gpt2', 'sequential')."""
    layers: tuple[LayerSpec, ...]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(last layer's output, target) -> the mean loss of the microbatch (Note: [loss])."""
    sample_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    """microbatch size -> (input, target) of that size, used by the profiler."""
    description: Mapping[str, Any] = field(default_factory=dict)
    """JSON-able architecture configuration; with the layers' parameter shapes and dtypes it
    makes the model's fingerprint (the profile-cache key)."""
    shared: tuple[SharedParameter, ...] = ()
    """Tied parameters (Note: [tied parameters])."""
    loss_count: Callable[[torch.Tensor], int] = counted_elements
    """target -> how many elements `loss` averages over."""
    export: Mapping[str, Any] = field(default_factory=lambda: {"format": "safetensors"})
    """How `python -m oobleck_elastic.export` writes the model's own format (JSON-able)."""
    vocab_size: int | None = None
    """Token ids must be below this (checked on the data); None: inputs are not token ids."""
    max_positions: int | None = None
    """Longest sequence the model takes; None: no limit."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one layer")
        for group in self.shared:
            for layer, _ in group.members:
                if not 0 <= layer < len(self.layers):
                    raise ValueError(f"shared parameter {group.members} names layer {layer}, but the model "
                                     f"has {len(self.layers)} layers")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def tied_copies(self) -> dict[int, dict[str, tuple[int, str]]]:
        """layer -> {parameter name -> canonical (layer, name)} for every copy of a tied parameter."""
        out: dict[int, dict[str, tuple[int, str]]] = {}
        for group in self.shared:
            for layer, name in group.members:
                out.setdefault(layer, {})[name] = group.canonical
        return out


def layer_seed(seed: int, index: int, salt: str = "layer") -> int:
    """A 63-bit seed for layer `index` of a run seeded `seed` (stable across processes); another
    `salt` gives another family of seeds (the trainer's per-step dropout seeds)."""
    digest = hashlib.sha256(f"oobleck-{salt}:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def materialize_layer(spec: ModelSpec, index: int, *, seed: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu", init: bool = True) -> nn.Module:
    """Builds layer `index` exactly as every other replica of it (Note: [layer initialisation]).
    `init=False`: its parameters' values are left undefined, for a transfer to overwrite (Note:
    [building without init])."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        with contextlib.nullcontext() if init else _without_init():
            module = spec.layers[index].factory()
    return module.to(device=device, dtype=dtype)


@contextlib.contextmanager
def _without_init():
    """Note: [building without init]
        A layer that is about to receive its whole state (parameters, persistent buffers and
        optimizer state) from a replica need not draw its random initial values first: for a
        150 MB layer that is most of the receiver's work. While the factory runs, torch.nn.init's
        in-place initialisers (kaiming_uniform_, normal_, zeros_, ...) return their tensor as
        it is, so parameters keep torch.empty's memory. Buffers computed another way (a causal
        mask, rotary frequencies), persistent or not, are built as always. Only the worker's
        main thread builds layers."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}

    def keep(tensor, *args, **kwargs):
        return tensor
    try:
        for n in names:
            setattr(nn.init, n, keep)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def _meta_states(spec: ModelSpec, dtype: torch.dtype) -> list[tuple[str, str, list[tuple[str, list[int], str]]]]:
    """(name, module type, [(state key, shape, dtype)]) of every layer, built on the meta device."""
    layers = []
    for layer in spec.layers:
        with torch.device("meta"):
            module = layer.factory()
        module = module.to(dtype=dtype)
        state = [(k, list(v.shape), str(v.dtype)) for k, v in module.state_dict(keep_vars=True).items()]
        layers.append((layer.name, type(module).__qualname__, state))
    return layers


def model_fingerprint(spec: ModelSpec, dtype: torch.dtype) -> str:
    """A digest of the architecture: its description and every layer's module type, parameter
    and buffer names, shapes and dtypes (built on the meta device: nothing is allocated or
    loaded). Two models with the same fingerprint profile the same."""
    layers = [list(layer) for layer in _meta_states(spec, dtype)]
    blob = json.dumps({"description": spec.description, "layers": layers,
                       "shared": [list(map(list, g.members)) for g in spec.shared]}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def state_shapes(spec: ModelSpec, dtype: torch.dtype) -> dict[str, str]:
    """Every state_dict entry of the model as 'dtype[shape]', under the model's own names (what
    a checkpoint's manifest records, so a mismatch can be named)."""
    return {key: f"{kind.removeprefix('torch.')}{shape}"
            for _, _, state in _meta_states(spec, dtype) for key, shape, kind in state}


def boundary_activations(spec: ModelSpec, dtype: torch.dtype, microbatch_input: torch.Tensor) -> list[torch.Tensor]:
    """Meta tensors of what crosses each layer boundary for one microbatch: entry 0 is the
    input (shaped like `microbatch_input`), entry i the output of layer i - 1. Computed by
    running every layer on the meta device (nothing allocated or loaded), so pipeline stages
    know their shapes before the first step (Note: [static stage shapes] in
    runtime/generation.py). Floating activations after the input require grad, as received
    activations do."""
    x = torch.empty_strided(microbatch_input.shape, microbatch_input.stride(), dtype=microbatch_input.dtype,
                            device="meta")
    out = [x]
    with torch.no_grad():
        for layer in spec.layers:
            with torch.device("meta"):
                module = layer.factory()
            x = module.to(dtype=dtype)(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"layer {layer.name!r} returned {type(x).__name__}, not a tensor")
            out.append(x.detach().requires_grad_(x.is_floating_point()))
    return out
