"""Copies layer state (parameters, optimizer state) between workers, point to point.

Note: [transfer wire format]
    For each (layer, src, dst) of a transfer plan the sender flattens the layer's
    `LayerState.state_tensors()` into one buffer per (device, dtype), in order of first appearance, and
    sends each with its own tag; the receiver, holding a freshly built replica of the same
    layer (optimizer primed when the run has stepped), receives into buffers of the same shapes
    and copies them in. Both sides derive shapes from the same layer factory, so nothing but
    tensor bytes crosses the wire, and a recovered replica is bit-identical to its source.
    All sends and receives are posted at once (isend/irecv) and then awaited, so the order of
    transfers cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from oobleck_elastic.planning import Transfer, WorkerRef
from oobleck_elastic.runtime.layers import LayerStore, flatten, unflatten
from oobleck_elastic.runtime.plan import GenerationPlan

__all__ = ["run_transfers"]

_TAGS_PER_TRANSFER = 16


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    # by device too: on CUDA an optimizer keeps its step counters on the CPU (they travel on
    # gloo, the parameters device to device on NCCL: runtime.devices Note: [devices])
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    if len(buckets) > _TAGS_PER_TRANSFER:
        raise ValueError(f"a layer's state has {len(buckets)} dtypes; at most {_TAGS_PER_TRANSFER} are supported")
    return list(buckets.values())


def run_transfers(transfers: Sequence[Transfer], plan: GenerationPlan, me: WorkerRef, layers: LayerStore,
                  *, stepped: bool, timeout: timedelta) -> int:
    """Runs this worker's part of `transfers` in the current (new) generation's default group.
    Layers received are created in `layers` first. Returns bytes sent plus received here."""
    pending = []
    receiving = []
    moved = 0
    with torch.no_grad():
        for index, t in enumerate(transfers):
            if t.src == me:
                for k, bucket in enumerate(_by_dtype(layers[t.layer].state_tensors())):
                    flat = flatten([b.detach() for b in bucket])
                    moved += flat.numel() * flat.element_size()
                    pending.append(dist.isend(flat, dst=plan.rank_of(t.dst), tag=index * _TAGS_PER_TRANSFER + k))
            if t.dst == me:
                state = layers.materialize(t.layer)
                if stepped:
                    state.prime_optimizer()
                for k, bucket in enumerate(_by_dtype(state.state_tensors())):
                    flat = torch.empty(sum(b.numel() for b in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                    moved += flat.numel() * flat.element_size()
                    pending.append(dist.irecv(flat, src=plan.rank_of(t.src), tag=index * _TAGS_PER_TRANSFER + k))
                    receiving.append((flat, bucket))
        for work in pending:
            work.wait(timeout)
        for flat, bucket in receiving:
            for target, value in zip(bucket, unflatten(flat, bucket)):
                target.copy_(value)
    pending.clear()
    return moved
