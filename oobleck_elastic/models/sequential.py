"""The adapter for plain torch models: an nn.Sequential, or a list of modules or module
factories, each a layer with any number of parameters and buffers, and a mean loss.

Each layer's module is wrapped so that its state_dict keys carry the layer's name as prefix
(`3.weight` for entry 3 of an nn.Sequential, as nn.Sequential itself names it: runtime.model
Note: [parameter names]). Parameters an nn.Sequential shares between two entries (the same
nn.Parameter object) are found and declared tied (Note: [tied parameters]).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from oobleck_elastic.runtime.model import LayerSpec, ModelSpec, SharedParameter, counted_elements

__all__ = ["Prefixed", "sequential_model"]

Entry = nn.Module | Callable[[], nn.Module]


class Prefixed(nn.Module):
    """A layer module under the model's own name for it (`name.` prefixes its state keys)."""

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        if not name or "." in name:
            raise ValueError(f"layer name {name!r} must be non-empty and contain no '.'")
        self._inner_name = name
        self.add_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._inner_name)(x)


def _factory(name: str, entry: Entry) -> Callable[[], nn.Module]:
    if isinstance(entry, nn.Module):
        return lambda: Prefixed(name, copy.deepcopy(entry))
    if callable(entry):
        return lambda: Prefixed(name, entry())
    raise TypeError(f"layer {name!r} must be an nn.Module or a callable returning one, got {type(entry).__name__}")


def _shared_by_identity(names: Sequence[str], entries: Sequence[Entry]) -> list[tuple[str, ...]]:
    """Model names of parameters that several entries hold as the same nn.Parameter object."""
    seen: dict[int, list[str]] = {}
    for name, entry in zip(names, entries):
        if isinstance(entry, nn.Module):
            for key, p in entry.named_parameters(remove_duplicate=False):
                seen.setdefault(id(p), []).append(f"{name}.{key}")
    return [tuple(group) for group in seen.values() if len({n.split(".")[0] for n in group}) > 1]


def sequential_model(layers: nn.Sequential | Sequence[Entry], *,
                     loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     sample_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                     names: Sequence[str] | None = None,
                     name: str = "sequential", description: Mapping[str, Any] | None = None,
                     shared: Sequence[Sequence[str]] = (), loss_count: Callable[[torch.Tensor], int] = counted_elements,
                     vocab_size: int | None = None, max_positions: int | None = None) -> ModelSpec:
    """A ModelSpec whose layers are `layers`' entries, in order.

    An entry given as a module is copied by every worker that runs it (build the model after
    seeding, the same way in every process); one given as a callable is called inside the
    layer's seeded RNG (runtime.model Note: [layer initialisation]). `loss` is a mean (Note:
    [loss]). `shared` lists tied parameters by model name, e.g. [("0.weight", "3.weight")],
    the first canonical; an nn.Sequential's own shared parameters are found without it.
    """
    entries: list[Entry]
    if isinstance(layers, nn.Sequential):
        names = list(layers._modules) if names is None else list(names)
        entries = list(layers._modules.values())
    else:
        entries = list(layers)
        names = [str(i) for i in range(len(entries))] if names is None else list(names)
    if len(names) != len(entries) or len(set(names)) != len(names):
        raise ValueError(f"need one distinct name per layer, got {len(names)} names for {len(entries)} layers")
    index = {n: i for i, n in enumerate(names)}
    groups = [tuple(g) for g in shared] + [g for g in _shared_by_identity(names, entries) if g not in shared]
    ties = []
    for group in groups:
        try:
            ties.append(SharedParameter(tuple((index[n.split(".")[0]], n) for n in group)))
        except KeyError as exc:
            raise ValueError(f"shared parameter {group}: no layer is named {exc.args[0]!r}") from exc
    if description is None:
        description = {"layers": [repr(e) if isinstance(e, nn.Module) else getattr(e, "__qualname__", repr(e))
                                  for e in entries]}
    return ModelSpec(name=name, layers=tuple(LayerSpec(n, _factory(n, e)) for n, e in zip(names, entries)),
                     loss=loss, sample_batch=sample_batch, description=dict(description), shared=tuple(ties),
                     loss_count=loss_count, vocab_size=vocab_size, max_positions=max_positions)
