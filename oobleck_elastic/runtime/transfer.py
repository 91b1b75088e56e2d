"""Copies layer state (parameters, optimizer state) between workers, point to point.

Note: [transfer wire format]
    For each (layer, src, dst) of a transfer plan the sender walks the layer's
    `LayerState.state_tensors()` in order: each tensor of at least DIRECT_BYTES goes as a
    message of its own, sent from and received into the tensor itself (no copy on either
    side); the smaller ones are flattened into one buffer per (device, dtype), in order of
    first appearance (on CUDA an optimizer keeps its step counters on the CPU), and copied in
    on arrival. Message k of transfer i has tag i * MESSAGES + k. The receiver, holding a
    freshly built replica of the same layer (its optimizer primed when the run has stepped),
    derives the same messages from the same layer factory, so nothing but tensor bytes crosses
    the wire and a recovered replica is bit-identical to its source. All sends and receives are
    posted at once (isend/irecv) and then awaited, so the order of transfers cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from oobleck_elastic.planning import Transfer, WorkerRef
from oobleck_elastic.runtime.fault_hook import PhaseHook, no_phase
from oobleck_elastic.runtime.layers import LayerStore, flatten, unflatten
from oobleck_elastic.runtime.plan import GenerationPlan

__all__ = ["run_transfers"]

MESSAGES = 4096  # per transfer, at most
DIRECT_BYTES = 1 << 18  # a tensor this large is its own message


def _messages(tensors: Sequence[torch.Tensor]) -> list[tuple[bool, list[torch.Tensor]]]:
    """The layer's state as messages, (direct, tensors): a large contiguous tensor alone, sent
    and received in place; the rest by (device, dtype), through a flat buffer."""
    direct: list[tuple[bool, list[torch.Tensor]]] = []
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_contiguous() and t.numel() * t.element_size() >= DIRECT_BYTES:
            direct.append((True, [t]))
        else:
            # by device too: on CUDA an optimizer keeps its step counters on the CPU (they travel
            # on gloo, the parameters device to device on NCCL: runtime.devices Note: [devices])
            buckets.setdefault((t.device, t.dtype), []).append(t)
    messages = direct + [(False, bucket) for bucket in buckets.values()]
    if len(messages) > MESSAGES:
        raise ValueError(f"a layer's state makes {len(messages)} messages; at most {MESSAGES} are supported")
    return messages



def run_transfers(transfers: Sequence[Transfer], plan: GenerationPlan, me: WorkerRef, layers: LayerStore,
                  *, stepped: bool, timeout: timedelta, fault: PhaseHook = no_phase) -> int:
    """Runs this worker's part of `transfers` in the current (new) generation's default group.
    Layers received are created in `layers` first. Returns bytes sent plus received here.
    `fault` is called with transfer_send / transfer_receive once this worker's sends / receives
    are posted (testing/faults.py)."""
    pending = []
    receiving = []
    moved = 0
    with torch.no_grad():
        for index, t in enumerate(transfers):
            if t.src == me:
                held = [x.detach() for x in layers[t.layer].state_tensors()]
                for k, (direct, message) in enumerate(_messages(held)):
                    flat = message[0] if direct else flatten(message)
                    moved += flat.numel() * flat.element_size()
                    pending.append(dist.isend(flat, dst=plan.rank_of(t.dst), tag=index * MESSAGES + k))
            if t.dst == me:
                state = layers.materialize(t.layer, init=False)  # every value is about to arrive
                if stepped:
                    state.prime_optimizer()
                for k, (direct, message) in enumerate(_messages([x.detach() for x in state.state_tensors()])):
                    if direct:
                        flat = message[0]  # received in place
                    else:
                        flat = torch.empty(sum(b.numel() for b in message), dtype=message[0].dtype,
                                           device=message[0].device)
                        receiving.append((flat, message))
                    moved += flat.numel() * flat.element_size()
                    pending.append(dist.irecv(flat, src=plan.rank_of(t.src), tag=index * MESSAGES + k))
        if any(t.src == me for t in transfers):
            fault("transfer_send")
        if any(t.dst == me for t in transfers):
            fault("transfer_receive")
        for work in pending:
            assert work is not None, "None only for a rank outside the group; this is the default group"
            work.wait(timeout)
        for flat, message in receiving:
            for target, value in zip(message, unflatten(flat, message)):
                target.copy_(value)
    pending.clear()
    return moved
