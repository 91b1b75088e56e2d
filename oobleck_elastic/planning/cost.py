"""The cost model the planner optimises: 1F1B iteration time and per-worker memory of a split.

Note: [cost model]
    A pipeline of S stages runs M microbatches under torch's Schedule1F1B. Stage k (0-based)
    costs f_k forward and w_k forward + backward per microbatch (divided by the stage's width,
    the number of workers it spans: 1 in executable plans). Between stage k and k+1 each
    microbatch sends its activation forward and its gradient back, each costing
    c_k = latency + output_bytes(last layer of stage k) / bandwidth (intra-node bandwidth when
    both stages sit on one node, inter-node otherwise); c_{-1} = c_{S-1} = 0.

    Transfers do not overlap compute. torch posts each send together with the next receive
    from the same neighbour and waits for both before computing again, and a send completes
    only once its receiver has posted the matching receive (gloo; NCCL beyond its small eager
    messages). So every microbatch costs stage k one exchange with each neighbour:
    e_k = c_{k-1} + c_k on top of w_k (first and last stages one exchange, middle stages two).

        T(M) = max_k [ A_k + M * w_k + (M - 1) * e_k + bubble_k ]
        A_k      = sum_{i<k} (w_i + 2 c_i)                       fill and drain above stage k
        bubble_k = max(c_k, D_k + 2 c_k - (S - k - 1)(f_k + c_{k-1}))   first-gradient wait
                   (0 for the last stage)
        D_k      = sum_{i>k} w_i                                  compute below stage k

    Stage k cannot start before the first microbatch has crossed the stages above it, must
    then do M forward and backward passes and wait on M exchanges with each neighbour, and the
    last gradient has to travel back up: A_k + M w_k + M e_k, less the first exchange with the
    stage above (part of the fill) and the first with the stage below, which is the first-
    gradient wait: microbatch 0 goes down to the last stage and back (D_k + 2 c_k at least),
    of which the S - k - 1 extra warm-up forwards (each with its exchange above) hide
    (S - k - 1)(f_k + c_{k-1}), and it is an exchange, so at least c_k: that wait is
    bubble_k. Every term is a lower bound on the schedule's length, so T never exceeds a
    discrete-event simulation of torch's Schedule1F1B with rendezvous messages (`simulate.py`)
    and equals it for balanced stages without transfer time. What it leaves out is queueing
    behind other stages' warm-up and transfers; on planned splits of transformer-shaped
    profiles the simulation is within 10% (tests/unit/test_cost_model.py). Every term depends on
    one stage's layers, its position, its boundary with the stage above and the stages above
    it, which is what makes the template search exact (templates.py).

    After its last backward, stage k sums its gradients with the same layers' replicas in the
    other P - 1 pipelines and steps its optimizer: tail_k = ring(P) * g_k + o_k, where g_k is
    its gradient bytes over the inter-node bandwidth, ring(P) = 2(P - 1)/P (a ring all-reduce
    sends and receives that share of the bytes) and o_k the profiled optimizer step of its
    layers. Stage 0 finishes its backward last, but a later stage with more parameters can
    finish its tail later, so

        T(M) = max_k [ A_k + M * w_k + (M - 1) * e_k + bubble_k + tail_k ]

    (the runtime starts every all-reduce only after its own schedule ends; the optimizer
    steps after the step's statistics are summed world-wide, so o_k could wait for a slower
    stage's all-reduce: a small error the model accepts to keep one term per stage). tail_k
    depends on stage k's layers and P only, so the template search stays exact; templates
    are planned for P = f + 1 pipelines and an instantiation is timed with its real P.

    Memory of a worker on stage k: (parameters + gradients + optimizer state of its layers +
    (S - k) microbatches of saved activations) / width, because 1F1B keeps up to S - k
    microbatches in flight on stage k (torch's Schedule1F1B warms up with S - k forwards).

Note: [interleaved cost model]
    Under ScheduleInterleaved1F1B a pipeline of P workers runs v*P stages, stage k on worker
    k mod P. Worker p does M * W_p work (W_p: the compute of its v stages and each one's
    exchanges with its neighbours, w_k + e_k, as in the 1F1B model) and the fill/drain
    bubble shrinks to about (P - 1) stage times instead of (P - 1) worker times (Narayanan et
    al., 2021):

        T(M) = M * max_p W_p + (P - 1) * max_k (w_k + 2 c_k) + max_p sum_{k on p} tail_k

    This is an estimate, not the lower bound of the 1F1B model: the planner splits the layers
    into v*P stages with the 1F1B search (which balances stage times, and so worker times), then
    uses this formula to size pipelines. Memory of worker p: its stages' static state plus
    in-flight stage activations; torch warms worker p up with (v - 1) * R + 2 (P - 1 - p)
    forwards, R (microbatches per round) < 2P, so at most (v - 1)(2P - 1) + 2(P - 1 - p) + 1
    activations, each bounded by the largest of its stages'.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oobleck_elastic.planning.profile import ModelProfile

__all__ = ["Cluster", "CostTables", "interleaved_in_flight", "interleaved_iteration_ms", "interleaved_terms",
           "iteration_ms", "ring_factor", "stage_cycles", "stage_leads", "stage_tails", "stage_times"]


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The hardware a plan is made for."""

    workers_per_node: int
    memory_per_worker: int
    intra_node_bandwidth: float = 50.0
    """GB/s."""
    inter_node_bandwidth: float = 12.5
    """GB/s."""
    link_latency_us: float = 20.0

    def __post_init__(self) -> None:
        if self.workers_per_node < 1:
            raise ValueError(f"workers_per_node must be >= 1, got {self.workers_per_node}")
        if self.memory_per_worker <= 0:
            raise ValueError(f"memory_per_worker must be > 0, got {self.memory_per_worker}")

    def transfer_ms(self, nbytes: float, cross_node: bool) -> float:
        bandwidth = self.inter_node_bandwidth if cross_node else self.intra_node_bandwidth
        return self.link_latency_us / 1e3 + nbytes / (bandwidth * 1e9) * 1e3

    def allreduce_ms(self, nbytes: float, participants: int) -> float:
        """A ring all-reduce of `nbytes` over `participants` ranks on different nodes: each
        sends and receives 2(p - 1)/p of the bytes over the inter-node bandwidth (latency
        left out: one message per layer group, small beside the bytes)."""
        return ring_factor(participants) * nbytes / (self.inter_node_bandwidth * 1e9) * 1e3


def ring_factor(participants: int) -> float:
    """2(p - 1)/p: the share of its bytes each rank sends (and receives) in a ring all-reduce."""
    return 2 * (participants - 1) / participants if participants > 1 else 0.0


def _boundaries(num_stages: int, send_ms: Sequence[float]) -> tuple[list[float], list[float]]:
    """(c_{k-1}, c_k) of each stage, 0 where it has no neighbour."""
    up = [send_ms[k - 1] if k > 0 else 0.0 for k in range(num_stages)]
    down = [send_ms[k] if k < num_stages - 1 else 0.0 for k in range(num_stages)]
    return up, down


def stage_cycles(stage_ms: Sequence[float], send_ms: Sequence[float]) -> list[float]:
    """w_k + e_k of each stage: its compute and exchanges per microbatch (Note: [cost model])."""
    up, down = _boundaries(len(stage_ms), send_ms)
    return [w + a + b for w, a, b in zip(stage_ms, up, down)]


def stage_leads(stage_ms: Sequence[float], forward_ms: Sequence[float],
                send_ms: Sequence[float]) -> list[float]:
    """A_k + bubble_k - e_k of each stage: T(M) = max_k (lead_k + M * (w_k + e_k))."""
    num_stages = len(stage_ms)
    up, down = _boundaries(num_stages, send_ms)
    leads, ahead, below = [], 0.0, sum(stage_ms)
    for k, w in enumerate(stage_ms):
        below -= w
        bubble = (max(down[k], below + 2 * down[k] - (num_stages - k - 1) * (forward_ms[k] + up[k]))
                  if k < num_stages - 1 else 0.0)
        leads.append(ahead + bubble - up[k] - down[k])
        ahead += w + 2 * down[k]
    return leads


def iteration_ms(stage_ms: Sequence[float], forward_ms: Sequence[float], send_ms: Sequence[float],
                 microbatches: int, tail_ms: Sequence[float] | None = None) -> float:
    """T(M) of the cost model (see Note: [cost model]); tail_ms: each stage's gradient
    all-reduce and optimizer step (none when omitted)."""
    leads = stage_leads(stage_ms, forward_ms, send_ms)
    cycles = stage_cycles(stage_ms, send_ms)
    tails = tail_ms if tail_ms is not None else [0.0] * len(stage_ms)
    return max(lead + microbatches * c + t for lead, c, t in zip(leads, cycles, tails))


def interleaved_terms(stage_ms: Sequence[float], send_ms: Sequence[float], positions: int,
                      tail_ms: Sequence[float] | None = None) -> tuple[float, float]:
    """(per microbatch, fixed) of the interleaved estimate: T(M) = M * per + fixed (Note:
    [interleaved cost model]); arguments as interleaved_iteration_ms."""
    cycles = stage_cycles(stage_ms, send_ms[:-1])
    per_worker = max(sum(cycles[p::positions]) for p in range(positions))
    fill = max(w + 2 * c for w, c in zip(stage_ms, send_ms))
    tail = max(sum(tail_ms[p::positions]) for p in range(positions)) if tail_ms is not None else 0.0
    return per_worker, (positions - 1) * fill + tail


def interleaved_iteration_ms(stage_ms: Sequence[float], send_ms: Sequence[float], positions: int,
                             microbatches: int, tail_ms: Sequence[float] | None = None) -> float:
    """T(M) of `positions` workers running stage k on worker k mod positions (see Note:
    [interleaved cost model]); send_ms has one entry per stage, 0 for the last; tail_ms: each
    stage's all-reduce and optimizer step (summed per worker; none when omitted)."""
    per_worker, fixed = interleaved_terms(stage_ms, send_ms, positions, tail_ms)
    return microbatches * per_worker + fixed


def interleaved_in_flight(position: int, positions: int, virtual_stages: int) -> int:
    """Most stage activations worker `position` holds at once under ScheduleInterleaved1F1B."""
    return (virtual_stages - 1) * (2 * positions - 1) + 2 * (positions - 1 - position) + 1


def stage_times(profile: ModelProfile, cluster: Cluster, bounds: Sequence[int],
                nodes_of_stages: Sequence[int],
                width: int = 1) -> tuple[list[float], list[float], list[float]]:
    """(forward + backward, forward, send) times of stages [bounds[k], bounds[k+1]) on these nodes."""
    layers = profile.layers
    ranges = list(itertools.pairwise(bounds))
    compute = [sum(layers[i].compute_ms for i in range(a, b)) / width for a, b in ranges]
    forward = [sum(layers[i].forward_ms for i in range(a, b)) / width for a, b in ranges]
    sends = [cluster.transfer_ms(layers[bounds[k + 1] - 1].output_bytes,
                                 nodes_of_stages[k] != nodes_of_stages[k + 1])
             for k in range(len(compute) - 1)]
    return compute, forward, sends


def stage_tails(profile: ModelProfile, cluster: Cluster, bounds: Sequence[int],
                width: int = 1) -> tuple[list[float], list[float]]:
    """(gradient bytes / inter-node bandwidth in ms, optimizer ms) of stages [bounds[k],
    bounds[k+1]): tail_k at P pipelines is ring_factor(P) * the first + the second (Note:
    [cost model])."""
    layers = profile.layers
    ranges = list(itertools.pairwise(bounds))
    sync = [sum(layers[i].grad_bytes for i in range(a, b)) / width / (cluster.inter_node_bandwidth * 1e9) * 1e3
            for a, b in ranges]
    optimizer = [sum(layers[i].optimizer_ms for i in range(a, b)) / width for a, b in ranges]
    return sync, optimizer


class CostTables:
    """Prefix sums of a profile, as (L+1) x (L+1) matrices over layer ranges [l, e)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster) -> None:
        layers = profile.layers
        self.num_layers = len(layers)
        compute = np.concatenate([[0.0], np.cumsum([x.compute_ms for x in layers])])
        forward = np.concatenate([[0.0], np.cumsum([x.forward_ms for x in layers])])
        self.forward = forward[None, :] - forward[:, None]
        self.below = compute[-1] - compute  # below[e]: compute of layers e..L-1
        static = np.concatenate([[0.0], np.cumsum([float(x.static_bytes) for x in layers])])
        act = np.concatenate([[0.0], np.cumsum([float(x.activation_bytes) for x in layers])])
        self.compute = compute[None, :] - compute[:, None]
        self.static = static[None, :] - static[:, None]
        self.activation = act[None, :] - act[:, None]
        out = np.array([0.0] + [float(x.output_bytes) for x in layers])
        # send_ms[cross][e]: one message across the output of layer e-1 (a stage ending at e);
        # 0 at e = 0, which bounds no stage
        self.send_ms = {cross: np.array([0.0] + [cluster.transfer_ms(b, cross) for b in out[1:]])
                        for cross in (False, True)}
        self.upper = np.triu(np.ones_like(self.compute, dtype=bool), k=1)
        grads = np.concatenate([[0.0], np.cumsum([float(x.grad_bytes) for x in layers])])
        opt = np.concatenate([[0.0], np.cumsum([x.optimizer_ms for x in layers])])
        self.grad_bytes = grads[None, :] - grads[:, None]
        self.optimizer_ms = opt[None, :] - opt[:, None]
        self._cluster = cluster

    def tail(self, pipelines: int, width: int) -> np.ndarray:
        """tail(l, e): all-reduce over `pipelines` and optimizer step of a stage holding layers
        [l, e) across `width` workers (Note: [cost model])."""
        sync = self.grad_bytes / width / (self._cluster.inter_node_bandwidth * 1e9) * 1e3
        return ring_factor(pipelines) * sync + self.optimizer_ms / width

    def memory(self, begin: int, end: int, in_flight: int, width: int) -> float:
        """Bytes a worker of a stage holding layers [begin, end) across `width` workers needs with
        `in_flight` microbatches' activations stored."""
        return (self.static[begin, end] + in_flight * self.activation[begin, end]) / width
