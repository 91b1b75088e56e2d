"""The model interface: an ordered list of layer factories plus a loss.

Note: [layer initialisation]
    Layer i is built by its factory inside a forked RNG seeded from (seed, i), so every worker
    that materialises layer i gets identical weights without a broadcast, whatever other layers
    it builds and in whatever order.

Note: [loss]
    `ModelSpec.loss(output, target)` returns the *sum* over the microbatch's samples of each
    sample's loss (for a language model: the mean over its tokens). The runtime divides by the
    global batch size, so the gradient is the mean over the global batch whichever pipeline and
    microbatch a sample lands in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LayerSpec", "ModelSpec", "layer_seed", "materialize_layer", "materialize_layers", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class LayerSpec:
    """One entry of the model's layer list."""

    name: str
    factory: Callable[[], nn.Module]


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner and runtime see it."""

    layers: tuple[LayerSpec, ...]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(last layer's output, target) -> summed per-sample loss (see Note: [loss])."""
    sample_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    """microbatch size -> (input, target) of that size, used by the profiler."""
    signature: str
    """Identifies architecture and sizes; part of the profile cache key."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one layer")

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def layer_seed(seed: int, index: int) -> int:
    """A 63-bit seed for layer `index` of a run seeded `seed` (stable across processes)."""
    digest = hashlib.sha256(f"oobleck-layer:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def materialize_layer(spec: ModelSpec, index: int, *, seed: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> nn.Module:
    """Builds layer `index` exactly as every other replica of it (Note: [layer initialisation])."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        module = spec.layers[index].factory()
    return module.to(device=device, dtype=dtype)


def materialize_layers(spec: ModelSpec, indices: Sequence[int], *, seed: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> nn.ModuleList:
    return nn.ModuleList(materialize_layer(spec, i, seed=seed, dtype=dtype, device=device) for i in indices)
